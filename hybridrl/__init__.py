"""hybridrl: colocated single-controller hybrid-engine reinforcement learning for LLM agents."""

import os as _os

# Large host tensors (>= 2 MiB) on transparent huge pages: PyTorch's CPU allocator reads
# THP_MEM_ALLOC_ENABLE once, at its first allocation, so it is set here, before torch is imported
# by anything of ours (torchrun ranks inherit it). Memory released between modes (gradient buffers,
# the KV cache) is faulted back in 2 MiB pages instead of 4 KiB ones: re-creating a buffer then runs
# near copy speed rather than ~2-3x slower. THP_MEM_ALLOC_ENABLE=0 turns it off. HYBRIDRL_THP_DEFAULT
# marks the value as ours, not the user's: the disaggregated placement, whose training and rollout
# processes allocate side by side on the host's CPUs, turns it off (measured: they slowed each other
# by ~30% with it, ~12-15% without; see hybridrl/train.py).
if "THP_MEM_ALLOC_ENABLE" not in _os.environ:
    _os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    _os.environ["HYBRIDRL_THP_DEFAULT"] = "1"

__version__ = "0.1.0"
