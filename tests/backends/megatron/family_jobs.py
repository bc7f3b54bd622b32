"""Multi-rank jobs for the family tests (Qwen3, Qwen3-MoE, llama3-scaled Llama), real ranks under
torchrun (gloo), several jobs in one launch:

    torchrun --nproc-per-node 2 -m tests.backends.megatron.family_jobs OUT_DIR parity,train,replay \
        [scope=full] parity=DIR,... train=DIR,... replay=MOE_DIR,ROLLOUTS.pt

`scope=quick` (the default suite) runs each family under the layouts that exercise its code paths
once; `scope=full` adds the rest (DP=2 for all, MoE at TP=2 and packed, replay under PP=2 and packed).

Every job writes what it measured to OUT_DIR as JSON (rank 0) for the test to check; nothing is
asserted here. References are transformers models (tests/backends/families.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrl.backends.megatron import MegatronConfig, MegatronEngine
from hybridrl.backends.megatron import moe
from hybridrl.backends.megatron.parallel import destroy_model_parallel
from hybridrl.data.batch import Batch
from tests.backends.families import forced_routing_logits, load
from tests.backends.megatron.reference import hf_logits, numbers, pg_loss, sequence_batch, token_logprobs

TEMPERATURE = 0.7
LR = 1e-4


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _checkpoint(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def _family(path) -> str:
    cfg = json.loads((Path(path) / "config.json").read_text())
    rope = (cfg.get("rope_parameters") or {}).get("rope_type", "default")
    return "llama3" if cfg["model_type"] == "llama" and rope == "llama3" else cfg["model_type"]


def _engine(path, training=False, **cfg) -> MegatronEngine:
    destroy_model_parallel()
    return MegatronEngine.from_hf(path, MegatronConfig(micro_batch_size=2, **cfg), training=training)


# ------------------------------------------------------------------------------------------------
# parity: logits / logprobs / entropy vs transformers, HF -> Megatron -> HF, publication groups


SCOPE = {"full": False}


def _layouts(family: str) -> dict[str, dict]:
    if family == "qwen3_moe":
        layouts = {"ep2": {"ep": 2}, "pp2": {"pp": 2}}
        if SCOPE["full"]:
            layouts.update({"tp1": {}, "tp2": {"tp": 2}, "ep2-packed": {"ep": 2, "max_tokens_per_micro_batch": 24}})
        return layouts
    layouts = {"tp2": {"tp": 2}, "pp2": {"pp": 2}}
    if SCOPE["full"]:
        layouts["tp1"] = {}
    return layouts


def parity(out: Path, *dirs: str) -> None:
    results: dict = {}
    for path in dirs:
        family = _family(path)
        hf = load(path)
        batch = sequence_batch(5, vocab=hf.config.vocab_size, seed=1)
        ref_logits = hf_logits(hf, batch)
        ref_lp, ref_ent = token_logprobs(ref_logits, batch["input_ids"], batch["attention_mask"], TEMPERATURE)
        saved = _checkpoint(path)
        for name, layout in _layouts(family).items():
            engine = _engine(path, **layout)
            rec: dict = {"is_output_rank": engine.is_output_rank}
            logits = engine.compute_logits(batch)
            lp = engine.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
            if engine.is_output_rank:
                rec["logits_max_abs"] = float(ref_logits.abs().max())
                rec["logits_diff"] = float((logits - ref_logits).abs().max())
                rec["logprobs_diff"] = float((lp["logprobs"] - ref_lp).abs().max())
                rec["entropy_diff"] = float((lp["entropy"] - ref_ent).abs().max())
            exported = list(engine.iter_hf_tensors())
            rec["same_names"] = sorted(n for n, _ in exported) == sorted(saved)
            rec["bitwise"] = all(torch.equal(t.cpu(), saved[n]) for n, t in exported)
            rec.update(_publication(engine, saved))
            results.setdefault(family, {})[name] = _gather(rec)
    if dist.get_rank() == 0:
        (out / "parity.json").write_text(json.dumps(results, indent=1))


def _publication(engine: MegatronEngine, saved: dict) -> dict:
    """What a publication sends: every group written into fresh buffers equals the checkpoint; an
    expert's tensors are all in one group."""
    specs = engine.hf_group_specs()
    ok, whole = True, True
    for index, group in enumerate(specs):
        out = {name: torch.full(shape, float("nan"), dtype=dtype) for name, shape, dtype in group}
        engine.write_hf_group(index, out)
        ok &= all(torch.equal(out[name], saved[name]) for name in out)
        experts = {name.split(".mlp.experts.")[1].split(".")[0] for name in out if ".mlp.experts." in name}
        whole &= len(experts) <= 1 and (not experts or len(out) == 3)
    names = [name for group in specs for name, _, _ in group]
    return {"groups_equal_checkpoint": ok, "experts_whole": whole, "groups_cover": sorted(names) == sorted(saved)}


# ------------------------------------------------------------------------------------------------
# train: one step under a parallel layout vs transformers + AdamW


def _hf_step(path, batch: Batch, shards: list[Batch], aux_coef: float) -> dict[str, torch.Tensor]:
    """The same objective with transformers + torch AdamW; with `aux_coef` the Switch load-balancing
    loss E * sum_e f_e P_e of each sparse layer per micro-batch (the engine's: 2 rows of a data-parallel
    shard, padding excluded), weighted by the micro-batch's share of the global batch's real tokens."""
    from tests.backends.megatron.reference import hf_train_step

    model = load(path)
    if not aux_coef:
        hf_train_step(model, batch, lr=LR, weight_decay=0.1, clip_grad=1.0, mode="token-mean")
        return _state(model, path)
    model.train()
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR)
    total_real = float(batch["attention_mask"].sum())
    tokens = float(batch["loss_mask"].sum())
    loss = 0.0
    for shard in [mb for part in shards for mb in part.split(2)]:
        out = model(input_ids=shard["input_ids"], attention_mask=shard["attention_mask"], output_router_logits=True)
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        ids, mask = shard["input_ids"], shard["attention_mask"].bool()
        lp = torch.zeros(ids.shape)
        lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        token_loss, _ = pg_loss(lp * mask, None, shard)
        loss = loss + (token_loss * shard["loss_mask"]).sum() / tokens
        valid = mask.reshape(-1)
        n = float(valid.sum())
        for logits in out.router_logits:
            probs = torch.softmax(logits[valid].float(), dim=-1)
            picked = torch.topk(probs, model.config.num_experts_per_tok, dim=-1).indices
            f = torch.bincount(picked.reshape(-1), minlength=probs.shape[1]).float() / (n * picked.shape[1])
            aux = probs.shape[1] * (f * probs.mean(dim=0)).sum()
            loss = loss + aux_coef * aux * n / total_real
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return _state(model, path)


def _state(model, path) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names (per-expert tensors for MoE)."""
    state = {}                        # (transformers keeps each layer's experts in two 3-D tensors)
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                state[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :half]
                state[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                state[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            state[name] = t
    return {k: v.detach().clone() for k, v in state.items()}


def train(out: Path, *dirs: str) -> None:
    results = {}
    layouts = {"qwen3": [("tp2", {"tp": 2})], "llama3": [("pp2", {"pp": 2})],
               # packed at EP=2: the two ranks' shards pack into 3 and 2 micro-batches (the second
               # rank runs a filler so that every forward's token exchange has both ranks)
               "qwen3_moe": [("ep2-aux", {"ep": 2, "moe_aux_loss_coef": 0.01}),
                             ("ep2-packed", {"ep": 2, "max_tokens_per_micro_batch": 16})]}
    if SCOPE["full"]:
        layouts["qwen3_moe"] += [("ep2", {"ep": 2}), ("pp2-aux", {"pp": 2, "moe_aux_loss_coef": 0.01})]
    for path in dirs:
        family = _family(path)
        full = sequence_batch(8, vocab=json.loads((Path(path) / "config.json").read_text())["vocab_size"], seed=3)
        for name, layout in layouts[family]:
            engine = _engine(path, training=True, lr=LR, weight_decay=0.1, clip_grad=1.0, **layout)
            dp = engine.mesh.dp_size
            shards = full.chunk(dp)
            metrics = engine.train_step(shards[engine.mesh.dp_rank(dist.get_rank())], pg_loss)
            mine = {n: t.detach().cpu().clone() for n, t in engine.iter_hf_tensors()}
            coef = layout.get("moe_aux_loss_coef", 0.0)
            ref = _hf_step(path, full, shards, coef)
            diff = {n: float((mine[n] - ref[n]).abs().max()) for n in mine}
            rec = {"loss": metrics["loss"], "max_diff": max(diff.values()), "worst": max(diff, key=diff.get),
                   "metrics": metrics}
            if coef:                          # how far the aux loss moved the weights: it must show
                plain = _hf_step(path, full, shards, 0.0)
                rec["aux_effect"] = max(float((ref[n] - plain[n]).abs().max()) for n in mine)
            results.setdefault(family, {})[name] = _gather(rec)
    if dist.get_rank() == 0:
        (out / "train.json").write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------------------
# replay: the trainer's forward on rollouts of the native engine, with and without routing replay


def replay(out: Path, path: str, rollouts: str) -> None:
    batch = Batch(torch.load(rollouts))
    mask = batch["loss_mask"] > 0
    hf = load(path)
    results: dict = {}
    layouts = [("ep2", {"ep": 2})]
    if SCOPE["full"]:
        layouts += [("pp2", {"pp": 2}), ("ep2-packed", {"ep": 2, "max_tokens_per_micro_batch": 64})]
    for name, layout in layouts:
        engine = _engine(path, **layout)
        rec: dict = {}
        for mode in ("off", "rollout"):
            moe.set_mode(engine.model, mode)
            lp = engine.compute_logprobs(batch, on_last_stage=True)
            rec[mode] = moe.metrics(engine.model, engine.adapter.spec, dp_group=None,
                                    pp_group=_pp_group())
            if lp is not None:
                gap = (lp["logprobs"] - batch["behavior_logprobs"]).abs()[mask]
                rec[mode]["mismatch_mean_abs"] = float(gap.mean())
                if mode == "rollout":        # replay = transformers with its experts forced to the record
                    worst = 0.0
                    for row in range(len(batch)):
                        n = int(batch["attention_mask"][row].sum())
                        ids = batch["input_ids"][row, :n]
                        logits = forced_routing_logits(hf, ids, batch["routed_experts"][row, :n])
                        ref = torch.log_softmax(logits, dim=-1)[:-1].gather(1, ids[1:, None]).squeeze(1)
                        worst = max(worst, float((lp["logprobs"][row, 1:n] - ref).abs().max()))
                    rec["forced_routing_diff"] = worst
        results[name] = _gather(rec)
    results["recompute"] = _recompute(path, batch)
    if dist.get_rank() == 0:
        (out / "replay.json").write_text(json.dumps(results, indent=1))


def _pp_group():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def _recompute(path: str, batch: Batch) -> list:
    """Two training steps with replay on, with and without full activation recomputation (which runs
    every router twice per micro-batch): the same losses and weights."""
    batch.set("advantages", torch.linspace(-1, 1, len(batch)).unsqueeze(1).expand_as(batch["loss_mask"]).contiguous())
    runs = {}
    for recompute in (False, True):
        engine = _engine(path, training=True, ep=2, lr=LR, recompute_activations=recompute)
        moe.set_mode(engine.model, "rollout")
        mine = batch.chunk(2)[engine.mesh.dp_rank(dist.get_rank())]
        losses = [numbers(engine.train_step(mine, pg_loss))["loss"] for _ in range(2)]
        runs[recompute] = (losses, {n: t.detach().clone() for n, t in engine.iter_hf_tensors()})
    (a, wa), (b, wb) = runs[False], runs[True]
    return _gather({"losses": [a, b], "weights_diff": max(float((wa[n] - wb[n]).abs().max()) for n in wa),
                    "replay_metrics": moe.metrics(engine.model, engine.adapter.spec, dp_group=None, pp_group=None)})


# ------------------------------------------------------------------------------------------------
# checkpoint: the MoE model saved under EP=2 (experts sharded), SIGKILLed, resumed exactly


def checkpoint(out: Path, path: str, phase: str) -> None:
    """phase=save: two steps (load-balancing loss on), save, a third step, then SIGKILL; phase=load: a fresh
    engine loads the checkpoint and takes the third step."""
    import signal

    batch = sequence_batch(8, vocab=json.loads((Path(path) / "config.json").read_text())["vocab_size"], seed=5)
    engine = _engine(path, training=True, ep=2, lr=1e-3, moe_aux_loss_coef=0.01)
    mine = batch.chunk(2)[engine.mesh.dp_rank(dist.get_rank())]
    rec = {}
    if phase == "save":
        rec["before"] = [numbers(engine.train_step(mine, pg_loss))["loss"] for _ in range(2)]
        engine.save_checkpoint(out / "ckpt_ep2", extra={"policy_version": 2})
        rec["next"] = numbers(engine.train_step(mine, pg_loss))
    else:
        rec["extra"] = engine.load_checkpoint(out / "ckpt_ep2")
        rec["next"] = numbers(engine.train_step(mine, pg_loss))
    (out / f"ckpt_{phase}_rank{dist.get_rank()}.json").write_text(json.dumps(rec))
    dist.barrier()
    if phase == "save":
        os.kill(os.getpid(), signal.SIGKILL)


JOBS = {"parity": parity, "train": train, "replay": replay, "checkpoint": checkpoint}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out, jobs, *args = sys.argv[1:]
    SCOPE["full"] = "scope=full" in args
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for job in jobs.split(","):
        mine = [a.split("=", 1)[1] for a in args if a.startswith(job + "=")]
        JOBS[job](out, *[p for a in mine for p in a.split(",")])
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(main)
