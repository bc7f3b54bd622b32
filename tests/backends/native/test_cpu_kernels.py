"""The native engine's C kernels against torch (and float64) references; their build, cache and fallback;
the engine with them against the engine without them."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridrl.backends.native import cpu_kernels
from hybridrl.backends.native.core import choose_kernels
from hybridrl.backends.native.model import apply_rotary_
from hybridrl.rollout.protocol import SamplingParams
from tests.backends.native.conftest import PARITY, generate_all, prompts_of

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def kernels():
    try:
        return cpu_kernels.load()
    except cpu_kernels.KernelUnavailable as exc:     # a machine without a C compiler: the torch path serves
        pytest.skip(f"the C kernels cannot be built here: {exc}")


def reference_decode(q, kv_layer, tables, lens, scale):
    """Each row on its own, in float64: its blocks gathered in order, softmax(q k / sqrt d) v per head."""
    rows, heads, hd = q.shape
    bs, kv_heads = kv_layer.shape[1], kv_layer.shape[3]
    out = torch.empty(rows, heads, hd, dtype=torch.float64)
    for r in range(rows):
        n = int(lens[r])
        blocks = tables[r, : -(-n // bs)]
        tokens = kv_layer[blocks].reshape(-1, 2, kv_heads, hd)[:n].double()       # [n, 2, kv_heads, hd]
        for h in range(heads):
            k, v = tokens[:, 0, h // (heads // kv_heads)], tokens[:, 1, h // (heads // kv_heads)]
            p = torch.softmax((k @ q[r, h].double()) * scale, dim=0)
            out[r, h] = p @ v
    return out.reshape(rows, heads * hd)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (6, 2, 32, 16),       # the demo model
    (4, 4, 64, 4),        # no grouping
    (8, 1, 128, 16),      # one KV head for eight
    (6, 3, 48, 1),        # a head size with no specialised copy, one token per block
])
def test_paged_decode_equals_attention_over_each_rows_blocks(heads, kv_heads, head_dim, block_size, kernels):
    g = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks, width, rows = 64, 9, 7
    kv_layer = torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=g)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(rows)])
    tables[1] = tables[0]                                       # two rows sharing blocks (prefix sharing)
    lens = torch.tensor([1, width * block_size, 2, block_size, block_size + 1, 5, width * block_size - 3])
    # q as the engine passes it: a view into the fused projection, rows strided
    fused = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g) * 3
    q = fused[:, : heads * head_dim].view(rows, heads, head_dim)
    scale = head_dim ** -0.5
    out = cpu_kernels.paged_decode(q, kv_layer, tables, lens, scale, kernels)
    expected = reference_decode(q, kv_layer, tables, lens, scale)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(out[0].view(heads, head_dim)[0], kv_layer[tables[0, 0], 0, 1, 0])  # one key: its value


def test_paged_decode_row_depends_on_its_row_alone(kernels):
    """Batch invariance: a row's output is bitwise the same alone, in any batch, on 1 or 2 threads."""
    g = torch.Generator().manual_seed(3)
    kv_layer = torch.randn(32, 16, 2, 2, 32, generator=g)
    tables = torch.randint(0, 32, (6, 8), generator=g)
    lens = torch.tensor([128, 3, 77, 16, 100, 1])
    q = torch.randn(6, 6, 32, generator=g)
    together = cpu_kernels.paged_decode(q, kv_layer, tables, lens, 0.17, kernels)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [cpu_kernels.paged_decode(q[i:i + 1], kv_layer, tables[i:i + 1], lens[i:i + 1], 0.17, kernels)
                 for i in range(6)]
    finally:
        torch.set_num_threads(threads)
    reversed_rows = cpu_kernels.paged_decode(q.flip(0), kv_layer, tables.flip(0), lens.flip(0), 0.17, kernels)
    assert torch.equal(torch.cat(alone), together)
    assert torch.equal(reversed_rows.flip(0), together)


def test_rms_norm_equals_transformers(kernels):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = Qwen2RMSNorm(192, eps=1e-6)
    norm.weight.data = torch.randn(192, generator=g)
    wide = torch.randn(37, 300, generator=g) * 5
    x = wide[:, 50:242]                                       # strided rows
    with torch.no_grad():
        expected = norm(x)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, norm.weight.data, 1e-6, kernels), expected,
                               atol=1e-6, rtol=1e-6)


def test_silu_mul_equals_torch(kernels):
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(9, 2 * 512, generator=g) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -200.0])     # the edges of sigmoid
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = cpu_kernels.silu_mul(gate_up, kernels)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=2e-6)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("rows, k, out_features", [
    (16, 768, 1024),      # a decode step's qkv at ~100M parameters
    (5, 3072, 768),       # rows not a multiple of the tile, a long k
    (1, 37, 13),          # k with a tail of 5 after two vectors, features not a multiple of 4
    (64, 64, 576),        # the most rows the model sends, a small vocabulary head
])
def test_linear_equals_float64_and_a_row_depends_on_its_row_alone(rows, k, out_features, kernels):
    g = torch.Generator().manual_seed(rows + k)
    weight = torch.randn(out_features, k, generator=g) * k ** -0.5
    bias = torch.randn(out_features, generator=g)
    residual = torch.randn(rows, out_features, generator=g)
    wide = torch.randn(rows, k + 8, generator=g)
    x = wide[:, 3: 3 + k]                                    # strided rows, as a view of a wider tensor
    expected = residual.double() + F.linear(x.double(), weight.double(), bias.double())
    out = cpu_kernels.linear(x, weight, bias, residual, kernels)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(cpu_kernels.linear(x, weight, kernels=kernels).double(),
                               F.linear(x.double(), weight.double()), atol=2e-5, rtol=1e-5)
    alone = torch.cat([cpu_kernels.linear(x[r: r + 1], weight, bias, residual[r: r + 1], kernels)
                       for r in range(rows)])
    assert torch.equal(out, alone)                           # the same bits in any batch
    assert torch.equal(cpu_kernels.linear(x[1:], weight, bias, residual[1:], kernels), out[1:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(cpu_kernels.linear(x, weight, bias, residual, kernels), out)     # and on any threads
    finally:
        torch.set_num_threads(threads)


def test_linear_refuses_what_it_cannot_read(kernels):
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.linear(torch.zeros(2, 8), torch.zeros(8, 4).t(), kernels=kernels)
    with pytest.raises(ValueError, match=r"bias \(3,\) is not a contiguous \[4\]"):
        cpu_kernels.linear(torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(3), kernels=kernels)
    with pytest.raises(TypeError, match="float32"):
        cpu_kernels.linear(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(4, 8), kernels=kernels)


def test_rope_store_equals_rotary_then_cache_write(kernels, tiny_models):
    from hybridrl.backends.model_spec import ModelSpec
    from hybridrl.backends.native.model import RotaryTable

    spec = ModelSpec.from_dir(tiny_models("qwen2", hidden=192, heads=6, kv_heads=2, intermediate=64))
    heads, kv_heads, hd, bs = spec.num_heads, spec.num_kv_heads, spec.head_dim, 4
    rotary = RotaryTable(spec, 512, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    n = 11
    wide = torch.randn(n, (heads + 2 * kv_heads) * hd + 8, generator=g)
    qkv = wide[:, : (heads + 2 * kv_heads) * hd]                             # strided rows, as a view of a wider one
    positions = torch.randint(0, 512, (n,), generator=g)
    slots = torch.randperm(16 * bs, generator=g)[:n]
    cache = torch.randn(16, bs, 2, kv_heads, hd, generator=g)
    before, expected_qkv = cache.clone(), qkv.clone()
    cos, sin = rotary.lookup(positions, torch.float32)
    apply_rotary_(expected_qkv[:, : (heads + kv_heads) * hd].view(n, heads + kv_heads, hd), cos, sin)
    cpu_kernels.rope_store(qkv, rotary.table, positions, slots, cache, heads, kv_heads, hd, kernels)
    torch.testing.assert_close(qkv, expected_qkv, atol=1e-6, rtol=1e-6)
    flat, flat_before = cache.view(-1, 2 * kv_heads * hd), before.view(-1, 2 * kv_heads * hd)
    assert torch.equal(flat[slots], qkv[:, heads * hd:])                     # the rotated K and the V, exactly
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], flat_before[untouched])


def test_loading_leaves_the_process_float_environment_and_its_openmp_runtime(tmp_path):
    """Built and loaded in a fresh process: denormals still work (no -ffast-math start-up code flushed them
    to zero for everyone) and torch's OpenMP runtime is the only one mapped."""
    script = (
        "import json, torch\n"
        "from hybridrl.backends.native import cpu_kernels\n"
        "k = cpu_kernels.load()\n"
        "tiny = torch.tensor([1e-40]) * torch.tensor([1.0])\n"
        "print(json.dumps({'denormal': float(tiny), 'threaded': k.threaded,\n"
        "                  'runtimes': sorted(cpu_kernels._openmp_mapped()), 'path': str(k.path)}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HYBRIDRL_KERNEL_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["denormal"] > 0
    assert report["path"].startswith(str(tmp_path))
    assert len(report["runtimes"]) <= 1
    if report["runtimes"]:
        assert report["threaded"]


def test_build_is_cached_and_failures_name_the_cause(tmp_path):
    first = cpu_kernels.build(directory=tmp_path)
    stamp = first.path.stat().st_mtime_ns
    again = cpu_kernels.build(directory=tmp_path)
    assert again.path == first.path and again.path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]          # no temporary file left behind
    with pytest.raises(cpu_kernels.KernelUnavailable, match="does not run"):
        cpu_kernels.build(compiler=str(tmp_path / "no-such-cc"), directory=tmp_path / "other")
    failing = tmp_path / "failing-cc"
    calls = tmp_path / "calls"
    failing.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho x >> {calls}\n"
                       "echo 'cc: out of luck' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(cpu_kernels.KernelUnavailable, match="out of luck"):
        cpu_kernels.build(compiler=str(failing), directory=tmp_path / "other")
    tried = len(calls.read_text().splitlines())
    assert tried >= 2                                    # with and without -march=native / OpenMP
    with pytest.raises(cpu_kernels.KernelUnavailable, match="out of luck"):    # remembered, not retried
        cpu_kernels.build(compiler=str(failing), directory=tmp_path / "other")
    assert len(calls.read_text().splitlines()) == tried


def test_choice_of_kernels(monkeypatch, caplog):
    cpu, f32 = torch.device("cpu"), torch.float32
    assert choose_kernels("torch", cpu, f32) is None
    assert choose_kernels("auto", cpu, torch.bfloat16) is None
    with pytest.raises(ValueError, match="float32"):
        choose_kernels("c", cpu, torch.bfloat16)

    def unavailable():
        raise cpu_kernels.KernelUnavailable("no C compiler found")

    monkeypatch.setattr(cpu_kernels, "load", unavailable)
    with caplog.at_level(logging.WARNING):
        assert choose_kernels("auto", cpu, f32) is None
    assert "no C compiler found" in caplog.text
    with pytest.raises(ValueError, match="rollout.native.kernels=c.*no C compiler found.*kernels=auto"):
        choose_kernels("c", cpu, f32)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_engine_with_kernels_equals_engine_without(arch, tiny_models, make_engine, kernels, monkeypatch):
    """Greedy and seeded samples: the same ids, logprobs to float32 rounding, with chunked prefill,
    prefix sharing (several samples of one prompt) and rows of very different lengths. The linear kernel
    takes every decode step's products here (the tiny model's weights are under its size floor)."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_MIN_WEIGHTS", 0)
    model_dir = tiny_models(arch, **PARITY)
    prompts = prompts_of([2, 45, 17, 90, 5], seed=4)
    prompts += [prompts[1]] * 3
    params = [SamplingParams(max_new_tokens=30, temperature=0.0 if i % 3 == 0 else 0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for choice in ("c", "torch"):
        engine = make_engine(model_dir, kernels=choice, max_num_batched_tokens=40, block_size=8, max_num_seqs=8)
        outs[choice] = generate_all(engine, prompts, params)
        assert engine.stats()["kernels"] == choice
        assert engine.stats()["prefix_hit_tokens"] > 0
    for c, t in zip(outs["c"], outs["torch"]):
        assert c.token_ids == t.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(t.logprobs), atol=2e-5, rtol=0)
