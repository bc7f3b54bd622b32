"""`MegatronEngine`: a model of the training side on Megatron-core (`training.protocol.TrainEngine`),
driven SPMD by every rank of the training mesh.

Every rank builds the engine (after torch.distributed is up) and calls its methods together;
collectives inside keep the ranks in step. Data-parallel ranks receive different batches (the
dispatcher splits by `engine.mesh`); TP and PP peers of a DP group receive the same.

    engine = MegatronEngine.from_hf(model_dir, cfg)                      # actor
    ref = MegatronEngine.from_hf(model_dir, cfg, training=False)         # frozen reference
    critic = MegatronEngine.from_hf(model_dir, cfg, head="value")        # a value model
    out = ref.compute_logprobs(batch)          # Batch('logprobs' [B, T]) on output ranks
    metrics = engine.train_step(batch, loss_fn)

The head is a model option: with `head="value"` the decoder (embedding, layers, final norm) is the
actor's, loaded the same way, and the vocabulary projection is replaced by a value head
(`backends/megatron/critic.py`); its outputs are values instead of logprobs, token-aligned the
same way, and it is never published or exported as a policy.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from hybridrl.backends.megatron import cpu_compat
from hybridrl.backends.megatron.config import MegatronConfig
from hybridrl.backends.megatron.step import (StepLoss, assemble, check_train_batch, global_denominators, reduce_sums,
                                             step_metrics, timed_grad_reduce, training_state)
from hybridrl.data.batch import Batch
from hybridrl.distributed.collectives import collective_device
from hybridrl.distributed.mesh import Mesh
from hybridrl.training.protocol import GRADS, LM_HEAD, OPTIMIZER, PARAMS, TRAIN_MEMORY_TAGS, VALUE_HEAD, LossFn

if TYPE_CHECKING:
    from hybridrl.backends.megatron.lora import BaseModel

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    """CUDA (the current device) when the default process group runs NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MegatronEngine:
    """One model (this rank's TP shard of its PP stage), with optimizer and schedule when training."""

    def __init__(self, *, cfg: MegatronConfig, model_dir: Path, adapter, model,
                 ddp, optimizer, scheduler, device: torch.device, mesh: Mesh, training: bool, head: str = LM_HEAD,
                 lora=None):
        self.cfg = cfg
        self.model_dir = model_dir
        self.adapter = adapter
        self.model = model                  # the unwrapped GPTModel stage
        self.ddp = ddp                      # megatron DDP wrapper (training) or None
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.mesh = mesh
        self.training = training
        self.head = head
        self.num_steps = 0
        self.lora = lora                    # LoRA adapters (backends/megatron/lora.py: attach) or None
        self._lora_full = None                        # their gathered HF factors, until the next change
        self._group_names = None                      # the HF names of each publication group
        self._group_specs = None                      # hf_group_specs(), computed on first use
        self.passes = {"logprobs": 0, "train": 0}   # schedule runs, by kind (what a step costs, counted)
        from hybridrl.backends.megatron.model import local_layers
        from hybridrl.backends.megatron.weights import owned_params, slot_owners

        from hybridrl.backends.megatron.adapters.base import Role

        self.params = owned_params(adapter, model, local_layers(model))
        if head == VALUE_HEAD:      # the value head is no slot of the HF model: nothing of it is published
            self.params = {slot: p for slot, p in self.params.items() if slot.role is not Role.OUTPUT}
        with self._scope():
            self._owners = slot_owners(adapter, self.params)
        self._offloaded: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ building

    @classmethod
    def from_hf(cls, model_path: str | Path, cfg: MegatronConfig, *, training: bool = True,
                device: torch.device | None = None, head: str = LM_HEAD) -> "MegatronEngine":
        """Build this rank's part of the model from an HF directory (every rank calls this).

        Initialises Megatron's parallel state for (cfg.tp, cfg.pp, dp = world / (tp * pp)) if it is
        not yet; `training=False` gives a frozen model without optimizer (the reference), which
        shares the parallel state of an actor built in the same process. `head="value"`: a value
        model (the critic), its head initialised from the directory when it carries one."""
        import dataclasses

        from hybridrl.backends.megatron.adapters.base import Role
        from hybridrl.backends.megatron.critic import ValueHead, load_value_head
        from hybridrl.backends.megatron import parallel
        from hybridrl.backends.megatron.adapters import adapter_for
        from hybridrl.backends.megatron.model import (
            build_gpt_model,
            local_layers,
            mark_tensor_parallel,
            transformer_config,
        )
        from hybridrl.backends.megatron.model import DTYPES
        from hybridrl.backends.megatron.weights import load_hf_weights, owned_params
        from hybridrl.backends.model_spec import ModelSpec

        if head not in (LM_HEAD, VALUE_HEAD):
            raise ValueError(f"head={head!r}: '{LM_HEAD}' (next-token logits) or '{VALUE_HEAD}' (one value per position)")
        model_dir = Path(model_path)
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"{model_dir}: not an HF model directory (no config.json)")
        device = device or default_device()
        if device.type == "cpu":
            cpu_compat.activate()
        adapter = adapter_for(ModelSpec.from_dir(model_dir), tp=cfg.tp, ep=cfg.ep,
                              vocab_divisible_by=cfg.make_vocab_size_divisible_by)
        if cfg.share_prefix and adapter.spec.is_moe:
            raise ValueError(f"{model_dir}: share_prefix is not for mixture-of-experts models (their routing "
                             "record and load-balancing loss count every row's tokens); set share_prefix=False")
        with cpu_compat.device_scope(device):
            mesh = parallel.ensure_model_parallel(cfg.tp, cfg.pp, cfg.seed, ep=cfg.ep)
            tconfig = transformer_config(adapter.spec, cfg, device=device)
            spec = adapter.spec if head == LM_HEAD else dataclasses.replace(adapter.spec, tie_word_embeddings=False)
            model = build_gpt_model(spec, cfg, tconfig, padded_vocab_size=adapter.padded_vocab_size, device=device)
            params = owned_params(adapter, model, local_layers(model))
            if head == VALUE_HEAD:
                if model.post_process:
                    model.output_layer = ValueHead(spec.hidden_size, dtype=DTYPES[cfg.dtype], device=device)
                    load_value_head(model.output_layer, model_dir)
                params = {s: p for s, p in params.items() if s.role is not Role.OUTPUT}
            mark_tensor_parallel(params)
            load_hf_weights(adapter, params, model_dir)
            lora = None
            if cfg.lora.enabled and training and head == LM_HEAD:
                from hybridrl.backends.megatron.lora import attach

                lora = attach(model, adapter, cfg.lora, local_layers(model), seed=cfg.seed, dtype=DTYPES[cfg.dtype],
                       device=device)
            ddp = optimizer = scheduler = None
            if training:
                ddp, optimizer, scheduler = training_state(model, tconfig, cfg)
            else:
                model.requires_grad_(False)
                model.eval()
        engine = cls(cfg=cfg, model_dir=model_dir, adapter=adapter, model=model, ddp=ddp,
                     optimizer=optimizer, scheduler=scheduler, device=device, mesh=mesh, training=training, head=head,
                     lora=lora)
        log.info("megatron engine: %s%s, %d parameters, tp=%d pp=%d dp=%d, %s", adapter.family,
                 " + value head" if head == VALUE_HEAD else "", engine.num_parameters(), cfg.tp, cfg.pp,
                 mesh.dp_size, "training" if training else "frozen")
        return engine

    def _scope(self):
        return cpu_compat.device_scope(self.device)

    # ------------------------------------------------------------------------------ layout

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def is_output_rank(self) -> bool:
        """TP rank 0 of the last pipeline stage: where compute_logprobs returns its Batch."""
        return self.mesh.is_output_rank(self.rank)

    @property
    def is_loss_rank(self) -> bool:
        """The last pipeline stage: where the loss runs and `on_last_stage` results land."""
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage()

    def dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's data-parallel group (on the device its backend needs; back on return)."""
        return self._dp_reduce(tensor, dist.ReduceOp.SUM)

    def dp_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._dp_reduce(tensor, dist.ReduceOp.MAX)

    def _dp_reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        out = tensor.to(collective_device(group, self.device))
        dist.all_reduce(out, op=op, group=group)
        return out.to(tensor.device)

    def num_parameters(self) -> int:
        """Parameters of the whole model (all TP shards and PP stages; the vocabulary padding excluded)."""
        shapes = self.adapter.hf_shapes()
        return sum(torch.Size(s).numel() for s in shapes.values())

    def set_router_replay(self, mode: str) -> None:
        """Mixture-of-experts routing replay (`algo.router_replay`: "off" | "rollout"; `moe.py`): the
        routers use the batch's `routed_experts` for recorded tokens. A no-op for dense models."""
        from hybridrl.backends.megatron import moe

        moe.set_mode(self.model, mode)

    # ------------------------------------------------------------------------------ logprobs

    def compute_logprobs(self, batch: Batch, *, temperature: float = 1.0,
                         with_entropy: bool = False, on_last_stage: bool = False) -> Batch | None:
        """Token-aligned log-probabilities of `batch['input_ids']` under the model.

        logprobs[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]; position 0 and
        padded positions are 0. Returns Batch('logprobs' [B, T] float32 (+ 'entropy' [B, T])) on
        the output ranks (on the CPU), None elsewhere (`on_last_stage`: on every rank of the last
        pipeline stage, every TP rank there holding the same values). Trailing padding rows
        (batch.num_padding) are not computed (their rows are 0)."""
        if self.head != LM_HEAD:
            raise TypeError("compute_logprobs on a value-head engine: its outputs are values (compute_values)")
        return self._forward_only(batch, temperature, with_entropy, on_last_stage, "logprobs")

    def compute_values(self, batch: Batch, *, on_last_stage: bool = False) -> Batch | None:
        """values [B, T] float32 of a value-head engine, token-aligned (the head at t-1; 0 at position 0 and
        on padding), on the output ranks (`on_last_stage`: every rank of the last stage), None elsewhere."""
        if self.head != VALUE_HEAD:
            raise TypeError("compute_values on an LM-head engine: build it with head='value'")
        return self._forward_only(batch, 1.0, False, on_last_stage, "values")

    def _forward_only(self, batch: Batch, temperature: float, with_entropy: bool, on_last_stage: bool,
                      name: str) -> Batch | None:
        from hybridrl.backends.megatron.schedule import check_sequence_batch, run_schedule

        check_sequence_batch(batch)
        num_rows, length = batch["input_ids"].shape
        real = max(batch.num_valid, 1) if num_rows else 0
        results: list[tuple[torch.Tensor, torch.Tensor | None]] = []

        def on_output(mb, logits):
            logprobs, entropy = self._token_logprobs(mb, logits, temperature, with_entropy)
            results.append((logprobs.detach(), None if entropy is None else entropy.detach()))
            return logprobs.sum() * 0.0

        mbs = self._micro_batches(batch.slice(0, real)) if real else []
        if mbs:
            self.passes["logprobs"] += 1
            self.model.eval()
            with self._scope(), torch.no_grad():
                run_schedule(self._schedule_model(), mbs, on_output, forward_only=True, pp=self.cfg.pp)
        if not (self.is_loss_rank if on_last_stage else self.is_output_rank):
            return None
        out = {name: assemble(mbs, [r[0] for r in results], num_rows, length)}
        if with_entropy:
            out["entropy"] = assemble(mbs, [r[1] for r in results], num_rows, length)
        return Batch(out, num_padding=batch.num_padding)

    def value_head(self) -> dict[str, torch.Tensor] | None:
        """A value-head engine's head tensors on the last pipeline stage (None elsewhere)."""
        if self.head != VALUE_HEAD:
            raise TypeError("value_head on an LM-head engine")
        head = self.model.output_layer if self.model.post_process else None
        return None if head is None else {"weight": head.weight.detach().cpu().clone(),
                                          "bias": head.bias.detach().cpu().clone()}

    def compute_logits(self, batch: Batch) -> torch.Tensor | None:
        """Full logits [B, T, V] float32 (gathered over TP, vocabulary padding cut, padded positions
        0) on the output ranks, None elsewhere. For parity checks: it materialises the whole
        vocabulary per rank, which compute_logprobs never does."""
        from megatron.core import parallel_state as ps

        from hybridrl.backends.megatron.schedule import check_sequence_batch, run_schedule

        check_sequence_batch(batch)
        num_rows, length = batch["input_ids"].shape
        vocab = self.adapter.spec.vocab_size
        out = torch.zeros(num_rows, length, vocab, dtype=torch.float32)

        def on_output(mb, logits):
            group = ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, logits.contiguous(), group=group)
            full = mb.to_rows(torch.cat(parts, dim=-1)[..., :vocab].float())   # [b, T_mb, V]
            full = full * mb.attention_mask.unsqueeze(-1).to(full.dtype)
            t = mb.shape[1]
            out[torch.tensor(mb.rows), :t] = full.cpu()
            return logits.sum() * 0.0

        self.model.eval()
        with self._scope(), torch.no_grad():
            run_schedule(self._schedule_model(), self._micro_batches(batch), on_output, forward_only=True,
                         pp=self.cfg.pp)
        return out if self.is_output_rank else None

    def _token_logprobs(self, mb, logits, temperature, with_entropy):
        """What the loss sees per token: logprobs (+ entropy) of the LM head, or the value head's values."""
        from megatron.core import parallel_state as ps

        if self.head == VALUE_HEAD:
            from hybridrl.backends.megatron.logprobs import token_aligned

            return token_aligned(logits[..., 0].float(), mb.attention_mask), None

        from hybridrl.backends.megatron.logprobs import token_aligned, vocab_parallel_logprobs

        vocab_local = logits.shape[-1]
        logprobs, entropy = vocab_parallel_logprobs(
            logits, mb.next_token_targets(),
            vocab_start=ps.get_tensor_model_parallel_rank() * vocab_local,
            vocab_size=self.adapter.spec.vocab_size, group=ps.get_tensor_model_parallel_group(),
            temperature=temperature, with_entropy=with_entropy, chunk_tokens=self.cfg.logprob_chunk_tokens or None)
        logprobs = token_aligned(mb.to_rows(logprobs), mb.attention_mask)
        entropy = token_aligned(mb.to_rows(entropy), mb.attention_mask) if with_entropy else None
        return logprobs, entropy

    def _micro_batches(self, batch: Batch):
        from hybridrl.backends.megatron.schedule import micro_batches

        return micro_batches(batch, self.cfg.micro_batch_size, self.device,
                             max_tokens=self.cfg.max_tokens_per_micro_batch, share_prefix=self.cfg.share_prefix)

    def _schedule_model(self) -> torch.nn.Module:
        return self.ddp if self.ddp is not None else self.model

    # ------------------------------------------------------------------------------ training

    def train_step(self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0,
                   with_entropy: bool = False, extremes: Iterable[str] = (), capture: bool = False) -> dict[str, Any]:
        """One optimizer step on this DP rank's share of the global batch.

        `loss_fn(logprobs [b, T], entropy [b, T] | None, micro_batch) -> (token_loss [b, T],
        metrics {name: [b, T]})` runs per micro-batch; token_loss is reduced with
        batch['loss_mask'] by cfg.loss_aggregation over denominators counted on the whole global
        batch (all micro-batches, all DP ranks) before the first backward. Gradients are clipped
        by their global norm. Returns the same dict on every rank: loss, grad_norm, lr,
        num_tokens, num_sequences, each metric's masked token mean over the global batch and, for
        each name in `extremes`, its masked max and min over the global batch (`<name>_max`,
        `<name>_min`; +-inf when no token is masked in). `capture`: also 'logprobs' [B, T] float32,
        the detached values the loss saw (on the loss ranks; None elsewhere)."""
        from megatron.core import parallel_state as ps

        from hybridrl.backends.megatron.schedule import run_schedule

        if not self.training:
            raise RuntimeError("train_step on a frozen engine (built with training=False)")
        check_train_batch(batch)
        # Trailing padding rows carry a zero loss_mask: skip them, but keep one row so that every
        # DP rank runs the schedule (and joins the gradient reduction).
        rows = batch.slice(0, max(batch.num_valid, 1))
        if batch.num_valid == 0:
            rows.tensors["loss_mask"] = torch.zeros_like(rows["loss_mask"])
        dp_group = ps.get_data_parallel_group()
        step = StepLoss(self, loss_fn, global_denominators(self, rows, dp_group), temperature=temperature,
                         with_entropy=with_entropy, extremes=tuple(extremes), capture=capture)
        self.passes["train"] += 1
        self.model.train()
        mbs = self._micro_batches(rows)
        # the positions the model runs (padding included, a shared prefix once): against num_tokens,
        # what the layout costs
        step.sums["model_tokens"] = torch.tensor(float(sum(b * t for b, t in (mb.model_shape for mb in mbs))),
                                                 dtype=torch.float64)
        with self._scope():
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            comm: dict[str, float] = {}
            with timed_grad_reduce(self.ddp.config, self.device, comm):
                run_schedule(self.ddp, mbs, step, forward_only=False, pp=self.cfg.pp)
            lr = float(self.optimizer.param_groups[0]["lr"])
            _, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self._lora_full = None
            for name in step.extremes:
                for key in (f"{name}_max", f"{name}_min"):
                    step.highs.setdefault(key, torch.tensor(-float("inf"), dtype=torch.float64, device=self.device))
            reduced = reduce_sums(self, step.sums, dp_group, step.highs)
        self.num_steps += 1
        metrics = step_metrics(reduced, float(grad_norm or 0.0), lr, step.denominators)
        metrics["grad_reduce_s"] = comm.get("seconds", 0.0)      # this rank's, not reduced
        from hybridrl.backends.megatron import moe

        with self._scope():      # routing agreement, expert load, aux loss (MoE models; {} for dense)
            metrics.update(moe.metrics(self.model, self.adapter.spec, dp_group=dp_group,
                                       pp_group=ps.get_pipeline_model_parallel_group()))
        if capture:
            num_rows, length = batch["input_ids"].shape
            metrics["logprobs"] = assemble(mbs, step.seen, num_rows, length) if self.is_loss_rank else None
        return metrics

    # ------------------------------------------------------------------------------ weights

    def _policy_only(self, what: str) -> None:
        if self.head != LM_HEAD:
            raise TypeError(f"{what}: a value-head engine (a critic) is saved in the run's distributed checkpoints, "
                            "never published or exported as a policy")

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for the whole model, names sorted, on every rank of the model-parallel
        group (gathered over TP and PP one fused group at a time). Tensors may alias parameters:
        copy before modifying. Every rank of the model-parallel group must consume the iterator."""
        from hybridrl.backends.megatron.model import DTYPES
        from hybridrl.backends.megatron.weights import iter_hf_tensors

        self._policy_only("iter_hf_tensors")
        with self._scope():
            merge = self._lora_merge()
            for name, tensor in iter_hf_tensors(self.adapter, self.params, self._owners, dtype=DTYPES[self.cfg.dtype],
                                                device=self.device):
                yield name, merge(name, tensor)

    def iter_hf_groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Like `iter_hf_tensors`, one fused group (e.g. q, k, v of one layer) per item, in model order."""
        from hybridrl.backends.megatron.model import DTYPES
        from hybridrl.backends.megatron.weights import iter_hf_groups

        self._policy_only("iter_hf_groups")
        with self._scope():
            merge = self._lora_merge()
            for group in iter_hf_groups(self.adapter, self.params, self._owners, dtype=DTYPES[self.cfg.dtype],
                                        device=self.device):
                yield [(name, merge(name, tensor)) for name, tensor in group]

    def hf_group_specs(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """The exported fused groups (a slot's HF tensors, e.g. q/k/v of one layer) as (name, shape,
        dtype), in model order, known without gathering: what a publication plans its buckets from.
        Computed once (the layout is the model's): every call returns the same lists, not to be modified."""
        from hybridrl.backends.megatron.model import DTYPES
        from hybridrl.backends.megatron.weights import group_specs

        self._policy_only("hf_group_specs")
        if self._group_specs is None:
            self._group_specs = group_specs(self.adapter, DTYPES[self.cfg.dtype])
        return self._group_specs

    def hf_views(self) -> dict[str, torch.Tensor]:
        """HF name -> a view of this rank's own parameter wherever Megatron's layout is the HF one
        (`weights.lendable_views`): what an engine in this process may serve in place
        (`rollout.native.trainer_weights`). Empty where another stage holds part of the model or where LoRA
        adapters are merged into what is published."""
        from megatron.core import parallel_state as ps

        from hybridrl.backends.megatron.weights import lendable_views

        self._policy_only("hf_views")
        if self.lora is not None or ps.get_pipeline_model_parallel_world_size() > 1:
            return {}
        return lendable_views(self.adapter, self.params)

    def write_hf_group(self, index: int, out: dict[str, torch.Tensor]) -> None:
        """Write group `index` of `hf_group_specs()` into `out[name]` (contiguous tensors of those
        shapes), un-fusing in place. Every rank of the model-parallel group calls it, in order.
        Copies and collectives only: no CUDA literal to map, so no device scope (on a CPU its
        per-call Python dispatch doubled the time of a publication's writes)."""
        from hybridrl.backends.megatron.weights import write_group

        with torch.no_grad():
            write_group(self.adapter, index, self.params, self._owners, out)
            if self.lora is not None:       # the merged weights (an engine that takes whole models)
                from hybridrl.backends.megatron.lora import add_merged_

                if self._group_names is None:
                    self._group_names = [[name for name, _, _ in group] for group in self.hf_group_specs()]
                add_merged_(self, out, self._group_names[index])

    # ------------------------------------------------------------------------------ LoRA (lora.py)

    def lora_factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF module name -> full (A [r, in], B [out, r]) of every adapter, float32 on the CPU, on every rank
        of this model-parallel group (gathered once per optimizer step; every rank of the group calls it)."""
        from hybridrl.backends.megatron.lora import gathered

        return gathered(self)

    def load_lora_factors(self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set the adapters from full HF factors (what `lora_factors` returns; a PEFT directory's tensors)."""
        from hybridrl.backends.megatron.lora import load_full

        load_full(self.lora, factors)
        self._lora_full = None

    def adapter_source(self):
        """The adapters alone as a publication source (`lora.AdapterSource`): what a LoRA run publishes
        into an engine that applies them itself."""
        from hybridrl.backends.megatron.lora import AdapterSource

        return AdapterSource(self)

    def _lora_merge(self):
        from hybridrl.backends.megatron.lora import merge_fn

        return merge_fn(self)

    def base_model(self) -> "BaseModel":
        """The frozen base under the adapters, as an engine that computes logprobs (the reference)."""
        from hybridrl.backends.megatron.lora import BaseModel

        return BaseModel(self)

    def hf_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor `iter_hf_tensors` yields, known without gathering."""
        from hybridrl.backends.megatron.model import DTYPES

        dtype = DTYPES[self.cfg.dtype]
        return {name: (tuple(shape), dtype) for name, shape in self.adapter.hf_shapes().items()}

    def export_hf(self, out_dir: str | Path) -> None:
        """Write an HF directory (config.json, model.safetensors, tokenizer and generation files copied
        from the source directory). Every rank takes part in the gather; rank 0 writes."""
        from hybridrl.backends.megatron.checkpoint import export_hf

        self._policy_only("export_hf")
        export_hf(self, Path(out_dir))

    def export_peft(self, out_dir: str | Path) -> None:
        """Write a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) for the HF
        base model; every rank takes part, rank 0 writes."""
        from hybridrl.backends.megatron.lora import export_peft

        self._policy_only("export_peft")
        export_peft(self, Path(out_dir))

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> None:
        """Distributed checkpoint of model, optimizer, LR schedule, RNG states and `extra` (rank 0's)."""
        from hybridrl.backends.megatron.checkpoint import save_checkpoint

        with self._scope():
            save_checkpoint(self, Path(path), extra or {})

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore what `save_checkpoint` wrote (same tp/pp; dp may differ); returns `extra`."""
        from hybridrl.backends.megatron.checkpoint import load_checkpoint

        self._lora_full = None
        with self._scope(), torch.no_grad():
            return load_checkpoint(self, Path(path))

    def scale_lr(self, factor: float) -> dict[str, float]:
        """Multiply the learning-rate schedule (peak, floor, warm-up start, each parameter group's own) by
        `factor` from now on; the schedule is in the checkpoint, so a resumed run keeps it. Returns the
        current learning rate before and after."""
        sched = self.scheduler
        before = float(self.optimizer.param_groups[0]["lr"])
        sched.max_lr, sched.min_lr, sched.init_lr = sched.max_lr * factor, sched.min_lr * factor, sched.init_lr * factor
        for group in self.optimizer.param_groups:
            for key in ("max_lr", "min_lr"):
                if key in group:
                    group[key] *= factor
            group["lr"] = sched.get_lr(group)
        return {"before": before, "after": float(self.optimizer.param_groups[0]["lr"])}

    # ------------------------------------------------------------------------------ memory

    def offload(self, tags: Iterable[str] = TRAIN_MEMORY_TAGS, *, spill_dir: str | Path | None = None) -> int:
        """Release device memory for the rollout phase (`optimizer`, `grads`, `params`); returns the bytes
        moved to (or, for gradients, which hold nothing between steps, freed from) the device. On a CPU
        device optimizer state and parameters already live in host memory: only gradient buffers are
        released, and optimizer state is spilled to a file in `spill_dir` when one is given."""
        from hybridrl.backends.megatron.offload import offload

        tags = set(tags)
        unknown = tags - {OPTIMIZER, GRADS, PARAMS}
        if unknown:
            raise ValueError(f"offload: unknown memory tag(s) {sorted(unknown)}; known: {[OPTIMIZER, GRADS, PARAMS]}")
        with self._scope():
            return offload(self, optimizer=OPTIMIZER in tags, grads=GRADS in tags, params=PARAMS in tags,
                           spill_dir=Path(spill_dir) if spill_dir is not None else None)

    def reload(self) -> int:
        """Undo `offload` (nothing to do when nothing was released); returns the bytes brought back."""
        from hybridrl.backends.megatron.offload import reload

        if not self._offloaded:
            return 0
        with self._scope():
            return reload(self)

    def held_bytes(self) -> dict[str, int]:
        """Optimizer state and gradient bytes held on the device now, by accounting."""
        from hybridrl.backends.megatron.offload import held_bytes

        return held_bytes(self)
