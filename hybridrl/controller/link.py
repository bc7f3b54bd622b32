"""`Link`: how the controller moves the rollout side to a policy version and back. Each placement's
collection drives one (`collection.ModeSwitchLink`: the colocated switch; `collection.RemoteLink`:
publication to rollout ranks that never stop); `state.Serving` wraps the run's link to remember what
is served."""

from __future__ import annotations

from typing import Protocol


class Link(Protocol):
    def to_rollout(self, version: int, step: int) -> dict:
        """The rollout side serves `version` (a switch, or a publication); what it did."""
        ...

    def to_train(self) -> dict:
        """Back to training (a no-op where the training side never left)."""
        ...

    def ensure_rollout(self, version: int, step: int) -> dict | None:
        """Serving `version` for a validation; the switch made (None when nothing was switched)."""
        ...

    def ensure_train(self) -> None:
        """Training, whatever the link was doing."""
        ...
