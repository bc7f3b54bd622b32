"""Mixture of experts on Megatron: the TransformerConfig of a sparse model, routing replay, metrics.

Routing replay (R3, "rollout routing replay"): the rollout engine records, for every token it
computed, the top-k experts each sparse layer sent it to; a batch carries them as
`routed_experts` [B, T, moe_layers, top_k] (-1 where nothing was recorded: the last token of a
sequence, padding). With replay on, each router's forward takes the recorded experts for those
tokens instead of its own top-k, and its weights are the router's own probabilities gathered at
the recorded experts (softmax over them when the top-k is renormalised), so the router still gets
gradients; tokens without a record keep the router's own choice. Replay off: the router chooses,
and the record is only compared with its choice.

`RoutingReplay` is what megatron-core's top-k router calls for its top-k (it replaces the router's
`router_replay` hook, the same one megatron's own RouterReplay uses), one per sparse layer. Every
micro-batch sets its recorded experts before its forward (`set_micro_batch`). With full activation
recomputation the layer's forward runs twice for one micro-batch (first without gradients, again in
the backward pass, micro-batches in the order of their forwards), so the first call queues what it
used and the recomputation takes it from the queue: both passes route alike.

Metrics (`metrics`, over the global batch, real tokens only):
  moe/router_agreement    share of recorded (token, layer) pairs where the trainer's own top-k set
                          equals the rollout's (below 1 where routing is near a tie; a measure of
                          the rollout/trainer routing mismatch whatever the replay mode)
  moe/replay_agreement    the same for the experts actually used (1 with replay on)
  moe/router_overlap      mean |own top-k & recorded| / k
  moe/recorded_fraction   share of real tokens that had a record
  moe/aux_loss            the Switch load-balancing loss E * sum_e f_e P_e of the router's own
                          choice, per layer, token-weighted mean (logged whatever its coefficient)
  moe/load_imbalance/layer_i   max over experts / mean of the tokens each expert received
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from hybridrl.backends.megatron import upstream  # noqa: F401  (megatron-core imported first, there)
from megatron.core.transformer.moe import moe_utils as _moe_utils

# megatron-core 0.16.1 defines `te_general_gemm` only when Transformer Engine imports, yet its router
# gating tests `te_general_gemm is not None`: without TE (our local spec, any CPU) define it as None,
# which selects its plain torch.mm path.
if not hasattr(_moe_utils, "te_general_gemm"):
    _moe_utils.te_general_gemm = None

REPLAY_MODES = ("off", "rollout")
# stats per layer: recorded pairs, own == recorded, used == recorded, overlap sum, real tokens,
# aux * tokens, then the load of each expert
_FIXED = 6


def moe_config(spec, cfg) -> dict[str, Any]:
    """The TransformerConfig fields of the model's experts (dense models: only the dispatcher)."""
    if not spec.is_moe:
        return {"moe_token_dispatcher_type": "alltoall"}      # (the default rejects variable lengths)
    aux, z = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_intermediate_size,
        moe_router_topk=spec.num_experts_per_tok,
        moe_router_score_function="softmax",
        # top-k of the logits, softmax over those = the renormalised top-k probabilities
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z if z > 0 else None,
        moe_layer_freq=[1 if spec.moe_index(i) is not None else 0 for i in range(spec.num_layers)],
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.tp,
    )


class RoutingReplay:
    """The top-k of one sparse layer's router: its own, or the recorded experts (see the module doc)."""

    def __init__(self, router, moe_index: int, num_experts: int, pre_softmax: bool):
        self.router = router
        self.moe_index = moe_index                       # the layer's position on the record's layer axis
        self.num_experts = num_experts
        self.pre_softmax = pre_softmax                   # scores are probabilities (else logits)
        self.mode = "off"
        self.target: torch.Tensor | None = None          # [tokens, k] long, -1 where not recorded
        self.valid: torch.Tensor | None = None           # [tokens] bool: real (not padding)
        self.queue: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        self.stats: torch.Tensor | None = None
        self.filler = False                              # the micro-batch set is an expert-parallel filler
        self.fillers: list[bool] = []                    # `filler` of each forward a recomputation will rerun
        self.silent = False                              # this router forward adds no aux / z loss

    # -- installing and driving ---------------------------------------------------------------

    @staticmethod
    def install(model, spec, layers: Mapping[int, torch.nn.Module]) -> list["RoutingReplay"]:
        hooks = []
        for index, layer in sorted(layers.items()):
            moe = spec.moe_index(index)
            if moe is not None:
                router = layer.mlp.router
                hook = RoutingReplay(router, moe, spec.num_experts, not spec.norm_topk_prob)
                router.router_replay = hook
                router.register_forward_pre_hook(hook.enter)
                router.is_aux_loss_enabled = hook.aux_loss_enabled           # (instance attributes: this router)
                router.apply_z_loss = hook.apply_z_loss
                hooks.append(hook)
        attach(model, hooks)
        return hooks

    # -- no auxiliary losses on filler micro-batches -------------------------------------------

    def enter(self, router, args) -> None:
        """Before each router forward: whether it belongs to a filler (its first forward reads `filler`;
        the backward pass's recomputation of a forward takes what that forward used, in order)."""
        recompute = router.training and router.config.recompute_granularity == "full"
        if recompute and torch.is_grad_enabled():       # as `get_replay_topk` tells the two passes apart
            self.silent = self.fillers.pop(0) if self.fillers else self.filler
            return
        self.silent = self.filler
        if recompute:
            self.fillers.append(self.filler)

    def aux_loss_enabled(self) -> bool:
        """The router's own answer, except on a filler: its padding token adds no load-balancing loss."""
        return not self.silent and type(self.router).is_aux_loss_enabled(self.router)

    def apply_z_loss(self, logits, padding_mask=None):
        if self.silent:
            return logits
        return type(self.router).apply_z_loss(self.router, logits, padding_mask=padding_mask)

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        own_values, own = default_compute_topk(scores, topk, num_groups, group_topk)
        recompute = self.router.training and self.router.config.recompute_granularity == "full"
        if recompute and torch.is_grad_enabled():        # the backward pass recomputing this forward
            used, _ = self.queue.pop(0)
            return (own_values, own) if used is None else (scores.gather(1, used), used)
        target, valid = self.target, self.valid
        if target is not None and target.shape[0] != scores.shape[0]:
            raise RuntimeError(f"routing replay: {target.shape[0]} recorded tokens for a router input of "
                               f"{scores.shape[0]} tokens")
        used = None
        if target is not None:
            recorded = (target >= 0).all(dim=-1) & valid
            self._count(scores, own, target, recorded, valid)
            if self.mode == "rollout" and bool(recorded.any()):
                used = torch.where(recorded.unsqueeze(-1), target, own)
        elif valid is not None:
            self._count(scores, own, None, None, valid)
        if recompute:
            self.queue.append((used, None))
        if used is None:
            return own_values, own
        return scores.gather(1, used), used

    # -- metrics ------------------------------------------------------------------------------

    def _count(self, scores, own, target, recorded, valid) -> None:
        """Accumulate this micro-batch's agreement, load and aux statistics (real tokens only)."""
        with torch.no_grad():
            if self.stats is None:
                self.stats = torch.zeros(_FIXED + self.num_experts, dtype=torch.float64, device=scores.device)
            k = own.shape[1]
            used = own
            if target is not None:
                n_rec = recorded.sum()
                own_sorted, rec_sorted = own.sort(dim=-1).values, target.sort(dim=-1).values
                same = (own_sorted == rec_sorted).all(dim=-1) & recorded
                overlap = (own.unsqueeze(-1) == target.unsqueeze(-2)).any(dim=-1).sum(dim=-1).double() / k
                self.stats[0] += n_rec
                self.stats[1] += same.sum()
                self.stats[2] += same.sum() if self.mode == "off" else n_rec
                self.stats[3] += (overlap * recorded).sum()
                if self.mode == "rollout":
                    used = torch.where(recorded.unsqueeze(-1), target, own)
            n = valid.sum()
            self.stats[4] += n
            if int(n):
                probs = scores.float() if self.pre_softmax else torch.softmax(scores.float(), dim=-1)
                probs = probs[valid]
                picked = torch.bincount(own[valid].reshape(-1), minlength=self.num_experts).double()
                aux = self.num_experts * ((picked / (n * k)) * probs.mean(dim=0).double()).sum()
                self.stats[5] += aux * n
                self.stats[_FIXED:] += torch.bincount(used[valid].reshape(-1), minlength=self.num_experts).double()

    def reset(self) -> None:
        self.stats = None
        self.queue.clear()
        self.fillers.clear()
        self.filler = self.silent = False


# model -> its sparse layers' hooks, in layer order (a model without any has no entry: dense, or a
# separate reference model, which routes on its own)
_INSTALLED: "weakref.WeakKeyDictionary[Any, list[RoutingReplay]]" = weakref.WeakKeyDictionary()


def attach(model, hooks: list[RoutingReplay]) -> None:
    """Make `hooks` the routing replay of `model` (what `replays(model)` returns)."""
    _INSTALLED[model] = list(hooks)


def replays(model) -> list[RoutingReplay]:
    return list(_INSTALLED.get(model, ()))


def set_mode(model, mode: str) -> None:
    """Routing replay `mode` ("off" | "rollout") for every sparse layer of `model`."""
    if mode not in REPLAY_MODES:
        raise ValueError(f"router replay mode {mode!r}: one of {REPLAY_MODES}")
    for hook in replays(model):
        hook.mode = mode


@contextlib.contextmanager
def own_routing(model):
    """Routing replay off for the duration, restored after: a reference forward routes on its own.

    The KL reference is a fixed policy; replaying the rollout's routes (chosen by the current policy)
    in it would make the KL's target move with the policy. A separate reference model has no replay
    installed; the LoRA actor's base (`lora.BaseModel`, adapters off) shares the actor's routers, so
    it turns their replay off here: the reference routes itself whether LoRA is on or not."""
    hooks = replays(model)
    saved = [hook.mode for hook in hooks]
    for hook in hooks:
        hook.mode = "off"
    try:
        yield
    finally:
        for hook, mode in zip(hooks, saved):
            hook.mode = mode


def set_micro_batch(model, mb) -> None:
    """Before a micro-batch's forward: each sparse layer's recorded experts and real-token mask, in
    the router's token order ([s, b] flattened; packed: the pack's tokens)."""
    hooks = replays(model)
    if not hooks:
        return
    mask = mb.attention_mask.bool()
    routed = mb.batch.tensors.get("routed_experts")
    if mb.packed is not None:
        valid = mask[mask]                                                # [t]: all real
        target = routed.to(mask.device)[mask].long() if routed is not None else None    # [t, L, k]
    else:
        valid = mask.transpose(0, 1).reshape(-1)                          # [s * b]
        target = (routed.to(mask.device).transpose(0, 1).reshape(-1, *routed.shape[2:]).long()
                  if routed is not None else None)
    if mb.filler:                                # not counted in the metrics, no auxiliary losses
        valid = torch.zeros_like(valid)
    for hook in hooks:
        hook.filler = bool(mb.filler)
        hook.valid = valid
        hook.target = None if target is None else target[:, hook.moe_index]


def padding_mask(mb) -> torch.Tensor | None:
    """Megatron's MoE padding mask [b, s] (True = padding) of a padded micro-batch."""
    return None if mb.packed is not None else ~mb.attention_mask.bool()


def reset(model) -> None:
    for hook in replays(model):
        hook.reset()


def metrics(model, spec, *, dp_group, pp_group) -> dict[str, float]:
    """The routing metrics of everything run since `reset`, over the data-parallel group and every
    pipeline stage (each stage holds its own layers); the same dict on every rank."""
    if not spec.is_moe:
        return {}
    device = next(model.parameters()).device
    table = torch.zeros(spec.num_moe_layers, _FIXED + spec.num_experts, dtype=torch.float64, device=device)
    for hook in replays(model):
        if hook.stats is not None:
            table[hook.moe_index] = hook.stats.to(device)
    for group in (dp_group, pp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(table, group=group)
    recorded, tokens = float(table[:, 0].sum()), float(table[:, 4].sum())
    out: dict[str, float] = {}
    if recorded:
        out["moe/router_agreement"] = float(table[:, 1].sum()) / recorded
        out["moe/replay_agreement"] = float(table[:, 2].sum()) / recorded
        out["moe/router_overlap"] = float(table[:, 3].sum()) / recorded
    if tokens:
        out["moe/recorded_fraction"] = recorded / tokens
        out["moe/aux_loss"] = float(table[:, 5].sum()) / tokens
        load = table[:, _FIXED:]
        imbalance = load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)
        for i, layer in enumerate(spec.moe_layers):
            out[f"moe/load_imbalance/layer_{layer}"] = float(imbalance[i])
    return out


@contextlib.contextmanager
def aux_loss_scale(model, scale: float):
    """Scale the routers' auxiliary-loss coefficients by `scale` for one schedule run.

    With per-token loss reduction megatron-core multiplies each micro-batch's aux loss by its token
    count and the main loss is normalised by the global token count (here, in the loss function):
    `scale` = 1 / global tokens makes the aux term the token-weighted mean over the global batch."""
    hooks = replays(model)
    if not hooks:
        yield
        return
    config = hooks[0].router.config
    saved = (config.moe_aux_loss_coeff, config.moe_z_loss_coeff)
    try:
        config.moe_aux_loss_coeff = saved[0] * scale
        if saved[1] is not None:
            config.moe_z_loss_coeff = saved[1] * scale
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved
