"""Preflight refuses an RL run whose rollout engine holds another dtype than the trainer publishes
(the publication does not convert dtypes: the first publication would be refused after every rank
started), and a parity tolerance those dtypes cannot pass; each in one line naming the keys."""

from __future__ import annotations

import sys

import pytest

from hybridrl import preflight
from hybridrl.cli import main
from hybridrl.config.loader import load_config
from tests.launch import ROOT

GRPO = str(ROOT / "recipes" / "calc_grpo_cpu.yaml")
QWEN = str(ROOT / "recipes" / "qwen2.5_0.5b_gsm8k_calc.yaml")


def cfg(*overrides, recipe=GRPO):
    return load_config(recipe, ["model.path=/m", *overrides])


def refusal(*overrides, recipe=GRPO) -> str:
    with pytest.raises(preflight.PreflightError) as info:
        preflight.check_dtypes(cfg(*overrides, recipe=recipe))
    return str(info.value)


def test_train_and_rollout_dtypes_must_agree():
    preflight.check_dtypes(cfg("distributed.device=cpu"))                  # float32 and native auto on CPU
    preflight.check_dtypes(cfg(recipe=QWEN))                               # bfloat16 on both sides
    err = refusal("rollout.engine=sglang", "publish.verify=structure")     # the defaults: float32 vs bfloat16
    assert err == ("train.dtype=float32 but the rollout engine runs in bfloat16 (rollout.sglang.dtype): the weights "
                   "are published as they are, without conversion; set rollout.sglang.dtype=float32 or "
                   "train.dtype=bfloat16")
    err = refusal("distributed.device=cuda")                               # native auto is bfloat16 on CUDA
    assert "(rollout.native.dtype=auto on cuda)" in err and "set rollout.native.dtype=float32" in err
    assert "runs in float32" in refusal("train.dtype=bfloat16", "distributed.device=cpu")
    preflight.check_dtypes(cfg("train.dtype=bfloat16", "rollout.native.dtype=bfloat16", "publish.parity_tolerance=0.1"))


def test_a_parity_tolerance_the_dtypes_cannot_pass():
    bf16 = ("train.dtype=bfloat16", "rollout.native.dtype=bfloat16")
    err = refusal(*bf16)                                                   # the 1e-3 default with bfloat16
    assert err.startswith("publish.parity_tolerance=0.001 cannot pass in bfloat16") and \
        "set publish.parity_tolerance=0.1, or publish.parity_prompts=0" in err
    preflight.check_dtypes(cfg(*bf16, "publish.parity_prompts=0"))         # no probe: nothing to pass


def test_device_auto_on_a_cpu_build_does_not_import_torch():
    import subprocess

    code = ("import sys; from hybridrl import preflight; from hybridrl.config.loader import load_config; "
            f"preflight.check_dtypes(load_config({GRPO!r}, ['model.path=/m'])); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_hybridrl_train_stops_on_it_in_one_line(tmp_path, capsys, tiny_models):
    model = tiny_models("qwen2", init_std=0.05)
    capsys.readouterr()                                                    # what making the model printed
    code = main(["train", GRPO, f"model.path={model}", f"run.dir={tmp_path / 'run'}", "rollout.engine=sglang",
                 "publish.verify=structure", "--check"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "rollout.sglang.dtype" in err, err


def test_native_kernels_are_built_before_the_ranks_start_or_refused_when_insisted_on(tmp_path, monkeypatch):
    """kernels=auto compiles the C kernels into the cache the ranks load from; a machine that cannot build
    them gets a note (auto) or a refusal naming the cause and the fix (c); CUDA or bfloat16 cannot run them."""
    monkeypatch.setenv("HYBRIDRL_KERNEL_CACHE", str(tmp_path / "cache"))
    assert preflight.check_native_kernels(cfg("distributed.device=cpu")) == []
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".so"]          # built, ready for the ranks
    assert preflight.check_native_kernels(cfg("rollout.native.kernels=torch")) == []
    with pytest.raises(preflight.PreflightError, match=r"kernels=c: .*run on the CPU in float32.*bfloat16 on cuda"):
        preflight.check_native_kernels(cfg("distributed.device=cuda", "rollout.native.kernels=c"))
    assert preflight.check_native_kernels(cfg("distributed.device=cuda")) == []   # auto: torch there, as designed
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    notes = preflight.check_native_kernels(cfg("distributed.device=cpu"))
    assert len(notes) == 1 and "no-such-cc" in notes[0] and "torch operators" in notes[0]
    with pytest.raises(preflight.PreflightError, match=r"rollout.native.kernels=c: C compiler .*no-such-cc.* "
                                                       r"does not run.*Install a C compiler.*kernels=auto"):
        preflight.check_native_kernels(cfg("distributed.device=cpu", "rollout.native.kernels=c"))


def test_a_reduced_train_dtype_on_a_cpu_without_its_matrix_instructions():
    """bfloat16 training on a CPU runs at its matrix instructions' rate where it has them (AVX512-BF16, AMX) and
    emulated, many times slower than float32, where it has not: refused there before any process starts."""
    zen4 = {"fpu", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    icelake = {"fpu", "avx2", "avx512f", "avx512_vnni"}
    sapphire = {"fpu", "avx512f", "amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"}
    assert preflight.cpu_lacks_matrix_units("bfloat16", zen4) is None
    assert preflight.cpu_lacks_matrix_units("bfloat16", sapphire) is None
    assert preflight.cpu_lacks_matrix_units("float16", sapphire) is None
    assert preflight.cpu_lacks_matrix_units("bfloat16", icelake) == "no avx512_bf16 or amx_bf16 among /proc/cpuinfo's flags"
    assert preflight.cpu_lacks_matrix_units("float16", zen4) == "no avx512_fp16 or amx_fp16 among /proc/cpuinfo's flags"
    assert preflight.cpu_lacks_matrix_units("bfloat16", set()) is None                # flags unknown: the rank checks


def test_preflight_refuses_bfloat16_on_such_a_cpu_naming_the_fix(monkeypatch):
    bf16 = ("train.dtype=bfloat16", "rollout.native.dtype=bfloat16", "publish.parity_tolerance=0.1",
            "distributed.device=cpu")
    monkeypatch.setattr(preflight, "cpu_lacks_matrix_units", lambda dtype: "no avx512_bf16 or amx_bf16 among ...")
    err = refusal(*bf16)
    assert err.startswith("train.dtype=bfloat16 on this CPU: it has no bfloat16 matrix instructions (no avx512_bf16") \
        and "set train.dtype=float32" in err, err
    preflight.check_dtypes(cfg(*bf16[:3], "distributed.device=cuda"))   # a GPU run: the CPU's flags do not matter
    monkeypatch.setattr(preflight, "cpu_lacks_matrix_units", lambda dtype: None)
    preflight.check_dtypes(cfg(*bf16))
