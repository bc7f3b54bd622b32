"""The training side of `MegatronEngine` (engine.py): its DDP wrapper, optimizer and LR schedule
(`training_state`), and what one `train_step` computes: each micro-batch's loss with this rank's sums of
the loss, the metrics and their extremes (`StepLoss`), the gradient reduction's time
(`timed_grad_reduce`), the global batch's denominators (`global_denominators`) and the step's scalars from
the sums reduced over the data-parallel ranks (`reduce_sums`, `step_metrics`); `assemble` puts micro-batch
results (logprobs, entropy, values) back in batch order."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
import torch.distributed as dist

from hybridrl.algo.aggregation import Denominators, aggregate, count
from hybridrl.backends.megatron.config import MegatronConfig
from hybridrl.data.batch import Batch
from hybridrl.training.protocol import LossFn

if TYPE_CHECKING:
    from hybridrl.backends.megatron.engine import MegatronEngine


def training_state(model, tconfig, cfg: MegatronConfig):
    """Megatron DDP, its optimizer (Adam, clipping by the global norm) and the LR schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hybridrl.backends.megatron.model import DTYPES

    skip_one_rank_gathers()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=cfg.use_distributed_optimizer)
    ddp = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=model)
    dtype = DTYPES[cfg.dtype]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
                        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                        clip_grad=cfg.clip_grad, bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16,
                        params_dtype=dtype, use_distributed_optimizer=cfg.use_distributed_optimizer),
        [ddp])
    fuse_cpu_adam(optimizer)
    # Our losses are already normalised by global denominators: finalize without Megatron's own
    # 1/num_tokens scaling (it still all-reduces over DP and syncs tied embeddings over PP).
    tconfig.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(chunks, None, **kw)
    tconfig.no_sync_func = ddp.no_sync
    if dtype is torch.float16:
        tconfig.grad_scale_func = optimizer.scale_loss
    constant = cfg.lr_schedule == "constant"
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=cfg.lr_warmup_steps + 1 if constant else cfg.lr_decay_steps,
        lr_decay_style=cfg.lr_schedule, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant")
    return ddp, optimizer, scheduler


def fuse_cpu_adam(optimizer) -> int:
    """Switch the torch Adam that megatron-core builds for `optimizer="adam"` where neither Transformer Engine nor
    Apex is installed (`torch.optim.AdamW` with torch's defaults: on CPU tensors its per-tensor loop) to torch's
    fused CPU kernel (`fused=True`, torch >= 2.4): one pass over each parameter, its gradient and both moments,
    where the loop makes five and allocates two parameter-sized temporaries per tensor (the square root and the
    quotient). At ~100M parameters on a 2-core CPU: 0.04 s a step against 0.28 s, and no temporaries at the step.
    Only the groups whose parameters are all float32 or bfloat16 CPU tensors (the fused kernel's dtypes) change; the
    update is Adam's all the same (its last bits may differ: the fused kernel orders the arithmetic its own way).
    Returns the number of groups switched."""
    switched = 0
    for group in optimizer.param_groups:
        if "fused" not in group or not group["params"]:
            continue                       # not torch's Adam (Transformer Engine's or Apex's FusedAdam)
        if all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16) for p in group["params"]):
            group.update(fused=True, foreach=False)
            switched += 1
    return switched


def skip_one_rank_gathers() -> None:
    """Megatron's gradient reduce-scatter and parameter all-gather, skipped where they change nothing: a
    group of one rank whose output is its input (the same memory, the same length).

    With the distributed optimizer, megatron-core 0.16 reduce-scatters each gradient bucket into this
    rank's shard and all-gathers the parameter buffer from the shards after the optimizer step
    (distributed/param_and_grad_buffer.py: `_ParamAndGradBucketGroup.start_grad_sync` /
    `start_param_sync`, through the module's `dist_reduce_scatter_func` / `dist_all_gather_func`).
    On one data-parallel rank the shard is the whole bucket, so both are the identity, but gloo still
    copies the buffer through its own memory: at ~100M parameters on a 2-core CPU, 1.0-1.5 s of a
    4.3 s training step (the step, with these skipped: 2.9-3.3 s, the same bits). Asynchronous calls
    (overlap_grad_reduce / overlap_param_gather, whose callers wait on a handle) and every group of
    more ranks go to the collective as before. Installed once per process; idempotent."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        collective = getattr(buffers, name)
        if not isinstance(collective, UnlessIdentity):
            setattr(buffers, name, UnlessIdentity(collective))


class UnlessIdentity:
    """A reduce-scatter / all-gather function of megatron's signature (output, input, ..., group=,
    async_op=) that returns without calling `collective` where the call is the identity."""

    def __init__(self, collective):
        self.collective = collective

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *args: Any, group=None, async_op: bool = False,
                 **kwargs: Any) -> Any:
        if (not async_op and group is not None and group.size() == 1
                and output.data_ptr() == input.data_ptr() and output.numel() == input.numel()):
            return None
        return self.collective(output, input, *args, group=group, async_op=async_op, **kwargs)


@contextlib.contextmanager
def timed_grad_reduce(config: Any, device: torch.device, into: dict[str, float]) -> Iterator[None]:
    """While a training schedule runs: the seconds of its gradient reduction (Megatron's finalize step:
    the all-reduce over data-parallel ranks, the tied embeddings' over pipeline stages) into
    `into["seconds"]`, device-synchronised on CUDA."""
    import time

    finalize = config.finalize_model_grads_func

    def timed(*args: Any, **kwargs: Any) -> Any:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        try:
            return finalize(*args, **kwargs)
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            into["seconds"] = into.get("seconds", 0.0) + time.perf_counter() - started

    config.finalize_model_grads_func = timed if finalize is not None else None
    try:
        yield
    finally:
        config.finalize_model_grads_func = finalize


def _accumulate(sums: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    sums[key] = sums[key] + value if key in sums else value


def assemble(mbs, parts: list[torch.Tensor], num_rows: int, length: int) -> torch.Tensor:
    """Micro-batch results [b_i, T_i] (rows mb.rows) into one [num_rows, length] float32 tensor
    (zeros elsewhere)."""
    out = torch.zeros(num_rows, length, dtype=torch.float32)
    for mb, part in zip(mbs, parts):
        out[torch.tensor(mb.rows), : part.shape[1]] = part.float().cpu()
    return out


def check_train_batch(batch: Batch) -> None:
    from hybridrl.backends.megatron.schedule import check_sequence_batch

    check_sequence_batch(batch)
    if len(batch) == 0:
        raise ValueError("train_step got an empty batch: every data-parallel rank needs at least one row "
                         "(the dispatcher pads with zero-loss rows)")
    if "loss_mask" not in batch.tensors:
        raise KeyError(f"train_step needs 'loss_mask' [B, T]; the batch holds {sorted(batch.tensors)}")
    if batch["loss_mask"].shape != batch["input_ids"].shape:
        raise ValueError(f"loss_mask {tuple(batch['loss_mask'].shape)} and input_ids "
                         f"{tuple(batch['input_ids'].shape)} differ in shape")


class StepLoss:
    """The schedule's `on_output` of one training step: each micro-batch's loss, and this rank's sums of the
    loss and the metrics (`sums`), the extremes' max and -min over masked tokens (`highs`) and, with
    `capture`, the logprobs the loss saw (`seen`, per micro-batch)."""

    def __init__(self, engine: "MegatronEngine", loss_fn: LossFn, denominators: Denominators, *,
                 temperature: float, with_entropy: bool, extremes: tuple[str, ...], capture: bool):
        self.engine, self.loss_fn, self.denominators = engine, loss_fn, denominators
        self.temperature, self.with_entropy, self.extremes, self.capture = temperature, with_entropy, extremes, capture
        self.sums: dict[str, torch.Tensor] = {}
        self.highs: dict[str, torch.Tensor] = {}
        self.seen: list[torch.Tensor] = []

    def __call__(self, mb: Any, logits: torch.Tensor) -> torch.Tensor:
        engine = self.engine
        logprobs, entropy = engine._token_logprobs(mb, logits, self.temperature, self.with_entropy)
        if self.capture:
            self.seen.append(logprobs.detach())
        mask = mb.batch["loss_mask"].to(engine.device).float()
        token_loss, metrics = self.loss_fn(logprobs, entropy, mb.batch)
        token_loss = torch.where(mask > 0, token_loss, torch.zeros_like(token_loss))
        loss = aggregate(token_loss, mask, engine.cfg.loss_aggregation, self.denominators)
        _accumulate(self.sums, "loss", loss.detach().double())
        for name, value in metrics.items():
            if name in self.extremes:
                self._extremes(name, value.detach().double()[mask > 0])
            value = torch.where(mask > 0, value.detach().float(), torch.zeros_like(mask))
            _accumulate(self.sums, f"metric/{name}", value.sum().double())
        return loss

    def _extremes(self, name: str, on: torch.Tensor) -> None:
        if on.numel():
            for key, v in ((f"{name}_max", on.max()), (f"{name}_min", -on.min())):
                self.highs[key] = torch.maximum(self.highs[key], v) if key in self.highs else v


def global_denominators(engine: "MegatronEngine", rows: Batch, dp_group: Any) -> Denominators:
    """The loss's denominators: tokens and sequences of the global batch (every data-parallel rank's)."""
    local = count(rows["loss_mask"])
    # on the engine's device: on a GPU the data-parallel group is NCCL, which reduces no CPU tensor
    totals = torch.tensor([local.num_tokens, local.num_sequences], dtype=torch.float64, device=engine.device)
    with engine._scope():
        dist.all_reduce(totals, group=dp_group)
    return Denominators(float(totals[0]), float(totals[1]))


def reduce_sums(engine: "MegatronEngine", sums: dict[str, torch.Tensor], dp_group,
                highs: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Sum over DP on the last stage (`highs`: a max over DP), then share with every stage: {name: value}."""
    from megatron.core import parallel_state as ps

    names = sorted(sums)
    top = sorted(highs or {})
    if engine.is_loss_rank:
        values = (torch.stack([sums[n].to(engine.device) for n in names]) if names
                  else torch.zeros(0, dtype=torch.float64, device=engine.device))
        dist.all_reduce(values, group=dp_group)
        payload = [dict(zip(names, values.tolist()))]
        if top:
            maxima = torch.stack([highs[n].to(engine.device).double() for n in top])
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=dp_group)
            payload[0].update(zip(top, maxima.tolist()))
    else:
        payload = [None]
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast_object_list(payload, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
    return payload[0]


def step_metrics(reduced: dict[str, float], grad_norm: float, lr: float, denominators: Denominators) -> dict[str, Any]:
    """train_step's scalars from the sums reduced over the data-parallel ranks."""
    metrics: dict[str, Any] = {"loss": reduced.pop("loss", 0.0), "grad_norm": grad_norm, "lr": lr,
                               "num_tokens": denominators.num_tokens, "num_sequences": denominators.num_sequences,
                               "model_tokens": reduced.pop("model_tokens", 0.0)}
    for key, total in sorted(reduced.items()):
        if key.startswith("metric/"):
            metrics[key.removeprefix("metric/")] = total / max(denominators.num_tokens, 1.0)
        else:       # an extreme: the min travelled negated, so that one MAX reduces both
            metrics[key] = -total if key.endswith("_min") else total
    return metrics
