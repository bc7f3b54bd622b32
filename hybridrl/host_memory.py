"""Host tensors on transparent huge pages, set by the entry points before torch allocates anything.

PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation, and with it puts
allocations of 2 MiB and more on huge pages: memory released between modes (gradient buffers, the
KV cache) is then faulted back in 2 MiB pages instead of 4 KiB ones, so re-creating a buffer runs
near copy speed (measurements: docs/publication.md). When training and rollout
processes share a host's CPUs side by side (roles apart), faulting memory in at the same time with
huge pages slows them down more than without, so those runs keep small pages.

A value the user set is kept; `HYBRIDRL_THP_DEFAULT=1` marks a value set here (not by the user), so
that a later entry point in the same process tree may still choose for its placement.
"""

from __future__ import annotations

import os

_OURS = "HYBRIDRL_THP_DEFAULT"


def choose_pages(*, roles_apart: bool = False) -> None:
    """Huge pages for host tensors unless the user chose, or training and generation run side by side."""
    if "THP_MEM_ALLOC_ENABLE" in os.environ and os.environ.get(_OURS) != "1":
        return
    os.environ["THP_MEM_ALLOC_ENABLE"] = "0" if roles_apart else "1"
    os.environ[_OURS] = "1"
