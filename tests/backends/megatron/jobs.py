"""Multi-rank jobs for the Megatron backend tests, run as real ranks under torchrun (gloo):

    torchrun --nproc-per-node N -m tests.backends.megatron.jobs JOB OUT_DIR [ARGS...]

Each job writes what it measured to OUT_DIR (JSON from rank 0, tensors as .pt) for the test to
check; nothing is asserted here, so a failing comparison shows up as a test failure with numbers.
HYBRIDRL_TEST_DEVICE=cuda runs the ranks on GPUs (NCCL), HYBRIDRL_TEST_DTYPE picks the dtype.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrl.algo.aggregation import AGGREGATIONS
from hybridrl.backends.megatron import MegatronConfig, MegatronEngine
from hybridrl.backends.megatron.parallel import destroy_model_parallel
from tests.backends.megatron.reference import hf_logits, numbers, pg_loss, sequence_batch, token_logprobs

TEMPERATURE = 0.7
DEVICE = os.environ.get("HYBRIDRL_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("HYBRIDRL_TEST_DTYPE", "float32")


def _gather_to_rank0(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _vocab(path) -> int:
    return json.loads((Path(path) / "config.json").read_text())["vocab_size"]


def _checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


# ------------------------------------------------------------------------------------------------
# parity: logits / logprobs vs transformers, HF -> Megatron -> HF round trip


def parity(out: Path, *model_dirs: str) -> None:
    layouts = {"tp1": (1, 1, "sdpa"), "tp2": (2, 1, "sdpa"), "pp2": (1, 2, "sdpa"),
               "tp2-megatron-attention": (2, 1, "megatron")}
    if dist.get_world_size() == 1:
        layouts = {"tp1": (1, 1, "sdpa")}
    results: dict = {}
    for model_dir in model_dirs:
        hf = _hf_model(model_dir)
        batch = sequence_batch(5, vocab=hf.config.vocab_size, seed=1)
        ref_logits = hf_logits(hf, batch)
        ref_lp, ref_ent = token_logprobs(ref_logits, batch["input_ids"], batch["attention_mask"], TEMPERATURE)
        saved = _checkpoint_tensors(model_dir)
        family = hf.config.model_type
        for name, (tp, pp, attention) in layouts.items():
            destroy_model_parallel()
            engine = MegatronEngine.from_hf(model_dir, MegatronConfig(tp=tp, pp=pp, micro_batch_size=2, dtype=DTYPE,
                                                                      attention=attention), training=False)
            rec: dict = {"is_output_rank": engine.is_output_rank}
            logits = engine.compute_logits(batch)
            lp = engine.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
            if engine.is_output_rank:
                rec["logits_max_abs_diff"] = float((logits - ref_logits).abs().max())
                rec["logits_max_abs"] = float(ref_logits.abs().max())
                rec["logprobs_max_abs_diff"] = float((lp["logprobs"] - ref_lp).abs().max())
                rec["entropy_max_abs_diff"] = float((lp["entropy"] - ref_ent).abs().max())
                rec["padded_positions_zero"] = bool((lp["logprobs"][batch["attention_mask"] == 0] == 0).all())
            exported = list(engine.iter_hf_tensors())
            names = [n for n, _ in exported]
            rec["names_sorted"] = names == sorted(names)
            rec["same_names"] = sorted(names) == sorted(saved)
            rec["bitwise_equal"] = all(torch.equal(t.cpu(), saved[n]) for n, t in exported if n in saved)
            rec["num_parameters_matches_hf"] = engine.num_parameters() == sum(p.numel() for p in hf.parameters())
            results.setdefault(family, {})[name] = _gather_to_rank0(rec)
    if dist.get_rank() == 0:
        (out / "parity.json").write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------------------
# train: one step (and a second) under several layouts / micro-batch counts / aggregations


def _train_variants(world: int) -> list[dict]:
    if world == 1:
        base = [dict(tp=1, pp=1)]
    else:
        base = [dict(tp=2, pp=1), dict(tp=1, pp=1), dict(tp=1, pp=2)]
    variants = []
    for layout in base:
        for num_mbs in (1, 4):
            variants.append(dict(layout, num_mbs=num_mbs, mode="token-mean"))
    if world > 1:
        variants.append(dict(tp=2, pp=1, num_mbs=4, mode="token-mean", recompute=True))
    layout = dict(tp=1, pp=1)
    for mode in AGGREGATIONS[1:]:
        for num_mbs in (1, 4) if world == 1 else (4,):
            variants.append(dict(layout, num_mbs=num_mbs, mode=mode))
    return variants


def train(out: Path, model_dir: str, lr: str) -> None:
    """Global batch of 8 rows (7 real + 1 padding row, as the dispatcher pads), one step per variant."""
    from hybridrl.data.batch import Batch

    world = dist.get_world_size()
    full = sequence_batch(7, vocab=_vocab(model_dir), seed=3)
    full = full.pad_to(8, zero=["loss_mask"])
    results = []
    for variant in _train_variants(world):
        destroy_model_parallel()
        dp = world // (variant["tp"] * variant["pp"])
        rows = 8 // dp
        cfg = MegatronConfig(tp=variant["tp"], pp=variant["pp"], micro_batch_size=rows // variant["num_mbs"],
                             lr=float(lr), weight_decay=0.1, clip_grad=1.0, loss_aggregation=variant["mode"],
                             recompute_activations=variant.get("recompute", False))
        engine = MegatronEngine.from_hf(model_dir, cfg)
        mine: Batch = full.chunk(dp)[engine.mesh.dp_rank(dist.get_rank())]
        first = engine.train_step(mine, pg_loss, with_entropy=True)
        weights = {n: t.detach().cpu().clone() for n, t in engine.iter_hf_tensors()}
        second = engine.train_step(mine, pg_loss, with_entropy=True)
        key = f"w{world}_tp{variant['tp']}_pp{variant['pp']}_dp{dp}_mb{variant['num_mbs']}_{variant['mode']}"
        key += "_recompute" if variant.get("recompute") else ""
        if dist.get_rank() == 0:
            torch.save(weights, out / f"{key}.pt")
        results.append({"key": key, **variant, "dp": dp, "first": first, "second": second})
    results.append(_offload_roundtrip(model_dir, full, lr))
    results.append(_actor_and_reference(model_dir, full, lr))
    if dist.get_rank() == 0:
        (out / f"train_w{world}.json").write_text(json.dumps(results, indent=1))


def _offload_roundtrip(model_dir: str, full, lr: str) -> dict:
    """Two steps vs two steps with, in between, offload(optimizer, grads) + a logprob pass + reload,
    then offload(params) + reload; bytes reported by the engine and, on CUDA, seen by the allocator."""
    losses, moved = {}, {}
    for offload in (False, True):
        destroy_model_parallel()
        cfg = MegatronConfig(tp=dist.get_world_size(), pp=1, micro_batch_size=2, lr=float(lr))
        engine = MegatronEngine.from_hf(model_dir, cfg)
        engine.train_step(full, pg_loss)
        if offload:
            cuda = engine.device.type == "cuda"
            allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
            before = allocated()
            moved["offload"] = engine.offload(("optimizer", "grads"))
            moved["released"] = before - allocated()
            engine.compute_logprobs(full)                 # rollout-time use: no grads, no optimizer
            moved["reload"] = engine.reload()
            before = allocated()
            moved["offload_params"] = engine.offload(("params",))
            moved["released_params"] = before - allocated()
            moved["reload_params"] = engine.reload()
            if not cuda:   # CPU: optimizer state spilled to a file and freed, then read back
                import tempfile

                from hybridrl.backends.megatron.offload import _optimizer_tensors

                state_bytes = sum(t.numel() * t.element_size() for _, _, t in _optimizer_tensors(engine))
                with tempfile.TemporaryDirectory() as spill:
                    moved["spill"] = engine.offload(("optimizer",), spill_dir=spill)
                    moved["held_while_spilled"] = sum(t.numel() for _, _, t in _optimizer_tensors(engine))
                    moved["unspill"] = engine.reload()
                moved["optimizer_state_bytes"] = state_bytes
            moved["grad_bytes"] = sum(b.grad_data.numel() * b.grad_data.element_size() for b in engine.ddp.buffers)
            moved["param_bytes"] = sum(b.param_data.numel() * b.param_data.element_size() for b in engine.ddp.buffers)
        losses[offload] = engine.train_step(full, pg_loss)["loss"]
    return {"key": "offload", "plain": losses[False], "offloaded": losses[True], **moved}


def _actor_and_reference(model_dir: str, full, lr: str) -> dict:
    """An actor and a frozen reference in one process, sharing Megatron's parallel state."""
    destroy_model_parallel()
    cfg = MegatronConfig(tp=dist.get_world_size(), pp=1, micro_batch_size=4, lr=float(lr))
    actor = MegatronEngine.from_hf(model_dir, cfg)
    ref = MegatronEngine.from_hf(model_dir, cfg, training=False)
    before = actor.compute_logprobs(full)
    actor.train_step(full, pg_loss)
    after, ref_out = actor.compute_logprobs(full), ref.compute_logprobs(full)
    rec = {"key": "actor_and_reference", "is_output_rank": actor.is_output_rank}
    if actor.is_output_rank:
        rec["ref_equals_initial_actor"] = bool(torch.equal(ref_out["logprobs"], before["logprobs"]))
        rec["actor_moved"] = float((after["logprobs"] - before["logprobs"]).abs().max())
    try:
        ref.train_step(full, pg_loss)
    except RuntimeError as err:
        rec["ref_train_error"] = str(err)
    return _gather_to_rank0(rec)[0]


# ------------------------------------------------------------------------------------------------
# checkpoint: save -> kill -> load reproduces the next step exactly


CHECKPOINT_LAYOUTS = {"dp2": (1, 1), "pp2": (1, 2)}


def _draws() -> list[float]:
    """One draw from each of this rank's Python, numpy and torch CPU generators."""
    import random

    import numpy as np

    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def checkpoint(out: Path, model_dir: str, phase: str) -> None:
    """phase=save: per layout, save before any step (no optimizer state yet), 2 steps, save, 1 more
    step; then SIGKILL. phase=load: per layout, a fresh engine loads the later checkpoint and takes
    that step; at world 2 another loads the step-0 checkpoint and takes the first 3 steps, and a
    third takes them without loading anything."""
    record: dict = {}
    layouts = CHECKPOINT_LAYOUTS if dist.get_world_size() == 2 else {"dp2": (1, 1)}   # world 1: DP 2 -> 1
    for name, (tp, pp) in layouts.items():
        cfg = MegatronConfig(tp=tp, pp=pp, micro_batch_size=2, lr=1e-3, lr_warmup_steps=1,
                             lr_schedule="cosine", lr_decay_steps=10)

        def fresh_engine():
            destroy_model_parallel()
            return MegatronEngine.from_hf(model_dir, cfg)

        engine = fresh_engine()
        full = sequence_batch(8, vocab=_vocab(model_dir), seed=5)
        mine = full.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank(dist.get_rank())]
        rec = record[name] = {}
        if phase == "save":
            engine.save_checkpoint(out / f"ckpt_{name}_step0", extra={"policy_version": 0})
            rec["before"] = [numbers(engine.train_step(mine, pg_loss))["loss"] for _ in range(2)]
            for _ in range(1 + dist.get_rank()):        # every rank's generators at their own place
                _draws()
            engine.save_checkpoint(out / f"ckpt_{name}", extra={"data_cursor": 42, "policy_version": 3})
            rec["draws"] = _draws()
            rec["next"] = numbers(engine.train_step(mine, pg_loss))
        else:
            rec["extra"] = engine.load_checkpoint(out / f"ckpt_{name}")
            rec["num_steps"] = engine.num_steps
            rec["draws"] = _draws()
            rec["next"] = numbers(engine.train_step(mine, pg_loss))
            if dist.get_world_size() == 2:
                engine = fresh_engine()
                rec["step0_extra"] = engine.load_checkpoint(out / f"ckpt_{name}_step0")
                rec["from_step0"] = [numbers(engine.train_step(mine, pg_loss)) for _ in range(3)]
                engine = fresh_engine()
                rec["never_saved"] = [numbers(engine.train_step(mine, pg_loss)) for _ in range(3)]
    (out / f"{phase}_w{dist.get_world_size()}_rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    if phase == "save":
        os.kill(os.getpid(), signal.SIGKILL)        # no clean shutdown: the checkpoint must suffice


# ------------------------------------------------------------------------------------------------
# packed: sequence packing vs padded micro-batches, per layout


PACKED_LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
# (row, row it copies, leading tokens copied): rows 0-3 and 4-7 are the two DP ranks' halves; the
# shared positions carry loss (the batch's "prompt" is 2 tokens), so several rows train through them
SHARED_PREFIXES = ((1, 0, 5), (3, 0, 8), (5, 4, 4), (6, 4, 6))


def packed(out: Path, model_dir: str, lr: str, max_tokens: str) -> None:
    """Per layout: two train steps and a logprob pass with padded micro-batches (2 rows), with
    packs of at most `max_tokens` tokens, and with those packs sharing the rows' common prefixes,
    from the same weights on the same global batch (7 rows of mixed lengths, some beginning with
    the same tokens as another row of their DP rank's half, + 1 dispatcher padding row). Records
    losses, grad norms, logprobs (vs transformers too), the tokens the packs ran and the updated
    weights."""
    world = dist.get_world_size()
    full = sequence_batch(7, vocab=_vocab(model_dir), seed=3).pad_to(8, zero=["loss_mask"])
    ids = full["input_ids"]
    for row, source, count in SHARED_PREFIXES:
        ids[row, :count] = ids[source, :count]
    hf = _hf_model(model_dir)
    ref_lp, ref_ent = token_logprobs(hf_logits(hf, full), full["input_ids"], full["attention_mask"], TEMPERATURE)
    layouts = PACKED_LAYOUTS if world == 2 else {"dp1": (1, 1)}
    results = {}
    for name, (tp, pp) in layouts.items():
        for mode, tokens, share in (("padded", 0, False), ("packed", int(max_tokens), False),
                                    ("shared", int(max_tokens), True)):
            destroy_model_parallel()
            # packed: logprobs in chunks of 5 tokens too (several chunks per pack, over TP at tp2)
            cfg = MegatronConfig(tp=tp, pp=pp, micro_batch_size=2, max_tokens_per_micro_batch=tokens, lr=float(lr),
                                 weight_decay=0.1, clip_grad=1.0, logprob_chunk_tokens=5 if tokens else 0,
                                 share_prefix=share)
            engine = MegatronEngine.from_hf(model_dir, cfg)
            mine = full.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank(dist.get_rank())]
            mbs = engine._micro_batches(mine.slice(0, max(mine.num_valid, 1)))
            rec: dict = {"rows_per_micro_batch": [len(mb.rows) for mb in mbs],
                         "model_rows": [mb.model_shape[0] for mb in mbs],
                         "model_tokens": sum(mb.model_shape[0] * mb.model_shape[1] for mb in mbs),
                         "real_tokens": sum(int(mb.attention_mask.sum()) for mb in mbs)}
            lp = engine.compute_logprobs(mine, temperature=TEMPERATURE, with_entropy=True)
            rec["steps"] = [engine.train_step(mine, pg_loss, temperature=TEMPERATURE, with_entropy=True)
                            for _ in range(2)]
            if engine.is_output_rank:
                rows = slice(engine.mesh.dp_rank(dist.get_rank()) * len(mine), None)
                want_lp, want_ent = ref_lp[rows][: len(mine)], ref_ent[rows][: len(mine)]
                real = mine.num_valid
                rec["logprobs_vs_hf"] = float((lp["logprobs"][:real] - want_lp[:real]).abs().max())
                rec["entropy_vs_hf"] = float((lp["entropy"][:real] - want_ent[:real]).abs().max())
                torch.save(lp["logprobs"], out / f"logprobs_{name}_{mode}_rank{dist.get_rank()}.pt")
            weights = {n: t.detach().cpu().clone() for n, t in engine.iter_hf_tensors()}
            if dist.get_rank() == 0:
                torch.save(weights, out / f"weights_{name}_{mode}.pt")
            results.setdefault(name, {})[mode] = _gather_to_rank0(rec)
    if dist.get_rank() == 0:
        (out / f"packed_w{world}.json").write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------------------
# uneven: pipeline stages that do not divide the layers


def uneven(out: Path, model_dir: str, lr: str) -> None:
    """pp = world size on a model whose layer count it does not divide: logprobs vs transformers,
    layers per stage, the HF round trip; then one train step against the same step at pp=1 (dp =
    world), weights compared."""
    world = dist.get_world_size()
    hf = _hf_model(model_dir)
    full = sequence_batch(world * 2, vocab=hf.config.vocab_size, seed=2)
    ref_lp, _ = token_logprobs(hf_logits(hf, full), full["input_ids"], full["attention_mask"], TEMPERATURE)
    saved = _checkpoint_tensors(model_dir)
    rec: dict = {}
    weights = {}
    for pp in (world, 1):
        destroy_model_parallel()
        cfg = MegatronConfig(tp=1, pp=pp, micro_batch_size=2, lr=float(lr))
        engine = MegatronEngine.from_hf(model_dir, cfg)
        mine = full.chunk(engine.mesh.dp_size)[engine.mesh.dp_rank(dist.get_rank())]
        if pp > 1:
            rec["stage_layers"] = len(engine.model.decoder.layers)
            lp = engine.compute_logprobs(full, temperature=TEMPERATURE)
            if engine.is_output_rank:
                rec["logprobs_vs_hf"] = float((lp["logprobs"] - ref_lp).abs().max())
            rec["bitwise_round_trip"] = all(torch.equal(t.cpu(), saved[n]) for n, t in engine.iter_hf_tensors())
        rec[f"loss_pp{pp}"] = numbers(engine.train_step(mine, pg_loss))["loss"]
        weights[pp] = {n: t.detach().cpu().clone() for n, t in engine.iter_hf_tensors()}
    rec["weights_max_diff"] = max(float((weights[world][n] - weights[1][n]).abs().max()) for n in weights[1])
    records = _gather_to_rank0(rec)
    if dist.get_rank() == 0:
        (out / f"uneven_w{world}.json").write_text(json.dumps(records, indent=1))


def norms(out: Path, model_dir: str) -> None:
    """A bfloat16 model built on the CPU (the engine refuses bf16 on CPU for speed only; the model
    code is the GPU's): every parameter's dtype, and every published tensor's against hf_spec()."""
    from hybridrl.backends.megatron import cpu_compat, parallel
    from hybridrl.backends.megatron.adapters import adapter_for
    from hybridrl.backends.megatron.model import build_gpt_model, local_layers, mark_tensor_parallel, transformer_config
    from hybridrl.backends.megatron.weights import load_hf_weights, owned_params
    from hybridrl.backends.model_spec import ModelSpec

    cpu = torch.device("cpu")
    cpu_compat.activate()
    cfg = MegatronConfig(tp=dist.get_world_size(), dtype="bfloat16")
    adapter = adapter_for(ModelSpec.from_dir(Path(model_dir)), tp=cfg.tp)
    with cpu_compat.device_scope(cpu):
        mesh = parallel.ensure_model_parallel(cfg.tp, cfg.pp, cfg.seed)
        tconfig = transformer_config(adapter.spec, cfg, device=torch.device("cuda"))   # no bf16-on-CPU refusal
        tconfig.use_cpu_initialization = True
        model = build_gpt_model(adapter.spec, cfg, tconfig, padded_vocab_size=adapter.padded_vocab_size, device=cpu)
        params = owned_params(adapter, model, local_layers(model))
        mark_tensor_parallel(params)
        load_hf_weights(adapter, params, Path(model_dir))
    model.requires_grad_(False)
    engine = MegatronEngine(cfg=cfg, model_dir=Path(model_dir), adapter=adapter, model=model, ddp=None,
                            optimizer=None, scheduler=None, device=cpu, mesh=mesh, training=False)
    spec = engine.hf_spec()
    published = {n: (tuple(t.shape), t.dtype) for n, t in engine.iter_hf_tensors()}
    rec = {"param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
           "norm_dtypes": sorted({str(m.weight.dtype) for m in model.modules() if isinstance(m, torch.nn.RMSNorm)}),
           "num_norms": sum(isinstance(m, torch.nn.RMSNorm) for m in model.modules()),
           "published_dtypes": sorted({str(d) for _, d in published.values()}),
           "published_matches_spec": published == spec}
    if dist.get_rank() == 0:
        (out / "norms.json").write_text(json.dumps(_gather_to_rank0(rec)))
    else:
        _gather_to_rank0(rec)


JOBS = {"parity": parity, "train": train, "checkpoint": checkpoint, "packed": packed, "uneven": uneven,
        "norms": norms}


def main() -> None:
    torch.set_num_threads(1)
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    job, out, *args = sys.argv[1:]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    JOBS[job](out, *args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(main)
