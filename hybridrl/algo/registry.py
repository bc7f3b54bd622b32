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

import difflib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional, TypeVar

from hybridrl.config.fields import ConfigValueError

if TYPE_CHECKING:
    import torch

    from hybridrl.algo.groups import Reduce

T = TypeVar("T")


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


class Registry(Generic[T]):
    """Entries of one kind: the modules of a package of this project, plus `register()`ed ones and
    `module:ATTR` names."""

    def __init__(self, kind: str, package: str, attr: str, cls: type):
        self.kind, self.package, self.attr, self.cls = kind, package, attr, cls
        self._entries: dict[str, T] = {}           # by name: shipped (once imported) and register()ed
        self._imported: dict[str, T] = {}          # by 'module:ATTR'

    def register(self, entry: T) -> T:
        other = self._entries.get(entry.name)  # type: ignore[attr-defined]
        if other is not None and other is not entry:
            raise ValueError(f"{self.kind} {entry.name!r} is already registered")  # type: ignore[attr-defined]
        self._entries[entry.name] = entry  # type: ignore[attr-defined]
        return entry

    def shipped(self) -> list[str]:
        package = importlib.import_module(self.package)
        return sorted(info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_"))

    def names(self) -> list[str]:
        return sorted(set(self.shipped()) | set(self._entries))

    def get(self, name: str, *, key: str = "") -> T:
        """The entry called `name` (imports its module); ConfigValueError naming `key` when unknown."""
        key = key or self.kind
        if name in self._entries:
            return self._entries[name]
        if name in self._imported:
            return self._imported[name]
        if ":" in name:
            return self._import(name, key)
        if name in self.shipped():
            entry = getattr(importlib.import_module(f"{self.package}.{name}"), self.attr)
            return self.register(entry)
        hint = difflib.get_close_matches(name, self.names(), n=1)
        raise ConfigValueError(key, f"unknown {self.kind} {name!r}: {f'did you mean {hint[0]!r}? ' if hint else ''}"
                                    f"known: {self.names()}; one of your own is named 'module:ATTR' (an "
                                    f"hybridrl.algo.registry.{self.cls.__name__} in module.py on PYTHONPATH)")

    def check(self, key: str, name: str) -> None:
        """Config validation: a shipped or registered name passes without an import."""
        if name in self._entries or name in self._imported or (":" not in name and name in self.shipped()):
            return
        self.get(name, key=key)

    def _import(self, name: str, key: str) -> T:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr:
            raise ConfigValueError(key, f"{name!r} is not of the form 'module:ATTR'")
        try:
            entry = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigValueError(key, f"cannot load {self.kind} {name!r}: {type(err).__name__}: {err}") from None
        if not isinstance(entry, self.cls):
            raise ConfigValueError(key, f"{name!r} is a {type(entry).__name__}, not an "
                                        f"hybridrl.algo.registry.{self.cls.__name__}")
        self._imported[name] = entry
        return entry


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator", "hybridrl.algo.advantages", "ESTIMATOR", Estimator)
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "hybridrl.algo.losses", "POLICY_LOSS", PolicyLoss)


def estimator(name: str) -> Estimator:
    return ESTIMATORS.get(name, key="advantage")


def policy_loss(name: str) -> PolicyLoss:
    return POLICY_LOSSES.get(name, key="policy_loss")
