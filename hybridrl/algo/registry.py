"""The registries of advantage estimators and policy losses: name -> implementation, one definition.

An estimator is a module of `hybridrl/algo/advantages/`, a policy loss a module of
`hybridrl/algo/losses/`, named after the entry it defines (`ESTIMATOR` / `POLICY_LOSS`). The
config's validation, the objective, `hybridrl config show --explain` and the run ledger all read
the entry, so a new one is its module (plus, if it has knobs, their fields in `algo/config.py`).
`algo.advantage` / `algo.policy_loss` may also name `module:ATTR` of your own (imported from the
working directory or PYTHONPATH, on every rank), or an entry `register()`ed at import.

Import-light: validating a config lists the shipped modules without importing them, and the
shipped modules import torch inside their functions, so reading an entry's facts needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from hybridrl.registry import Registry

if TYPE_CHECKING:
    import torch

    from hybridrl.algo.groups import Reduce


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read. [N] per row, [N, T] token-aligned; `mask` is 1 on policy tokens."""

    rewards: "torch.Tensor"                         # [N] outcome reward
    group_index: "torch.Tensor"                     # [N] dense group ids; < 0 on filler rows
    mask: "torch.Tensor"                            # [N, T]
    token_rewards: "Optional[torch.Tensor]" = None  # [N, T] per-token rewards (e.g. -kl_coef * KL)
    values: "Optional[torch.Tensor]" = None         # [N, T] the critic's values (estimators that need one)
    num_groups: Optional[int] = None                # groups in the whole batch (a batch split over ranks)
    reduce: "Optional[Reduce]" = None               # a sum over the ranks holding the batch


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator.

    compute(cfg, inputs) -> (advantages [N, T], returns [N, T] or None): returns are the value
    targets of an estimator that trains a critic. `formula(cfg)` is what the run ledger records
    beside each row's advantage; `explain_row(cfg, group_rewards, i)` optional per-row extras
    (e.g. RLOO's leave-one-out baseline)."""

    name: str
    summary: str                       # one line: what the advantage of a token is
    compute: Callable[[Any, AdvantageInputs], tuple["torch.Tensor", "Optional[torch.Tensor]"]]
    formula: Callable[[Any], str]
    # the advantage compares a sample with its group: a group of one, or of equal rewards, carries no signal
    group_baseline: Callable[[Any], bool] = lambda cfg: True
    needs_critic: bool = False         # trains a value model (the `critic` section)
    explain_row: Optional[Callable[[Any, list, int], dict]] = None


@dataclass(frozen=True)
class PolicyLoss:
    """A per-token policy loss: compute(cfg, logprobs, old_logprobs, advantages) -> (token_loss [N, T],
    metrics {name: [N, T]}, with 'ratio' = exp(logprobs - old_logprobs)). `old_logprobs` are the
    proximal policy's (recomputed by the trainer before the step's first update); the objective
    multiplies the result by the behaviour weights of `algo/correction.py`."""

    name: str
    summary: str
    compute: Callable[..., tuple["torch.Tensor", dict]]


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator", key="advantage", row=Estimator,
                                           package="hybridrl.algo.advantages", attr="ESTIMATOR")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", key="policy_loss", row=PolicyLoss,
                                               package="hybridrl.algo.losses", attr="POLICY_LOSS")


def estimator(name: str) -> Estimator:
    return ESTIMATORS.get(name, key="advantage")


def policy_loss(name: str) -> PolicyLoss:
    return POLICY_LOSSES.get(name, key="policy_loss")
