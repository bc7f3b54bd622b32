"""Megatron's reduce-scatter and all-gather of the distributed optimizer's buffers are skipped only where
they are the identity: one rank, output and input the same memory of the same length, a synchronous
call. Every other call reaches the collective. (That a one-rank step trains to the same weights as
plain transformers + AdamW with the skip installed: tests/backends/megatron/test_train_step.py.)"""

from __future__ import annotations

import torch

from hybridrl.backends.megatron.step import UnlessIdentity, skip_one_rank_gathers


class Group:
    def __init__(self, ranks: int):
        self.ranks = ranks

    def size(self) -> int:
        return self.ranks


def _spied():
    calls = []

    def collective(output, input, *args, group=None, async_op=False, **kwargs):
        calls.append((output.data_ptr(), input.data_ptr(), group.size(), async_op, kwargs))
        return "work"

    return calls, UnlessIdentity(collective)


def test_one_rank_in_place_is_skipped_and_everything_else_reaches_the_collective():
    buffer = torch.zeros(64)
    shard = buffer[:64]                    # shard_buffer(buffer, 1)[0]: the whole bucket
    calls, call = _spied()
    assert call(shard, buffer, op="sum", group=Group(1)) is None
    assert calls == []
    assert call(buffer[:32], buffer, op="sum", group=Group(2)) == "work"       # two ranks: a real shard
    assert call(shard, buffer, group=Group(2)) == "work"                       # same memory, two ranks
    assert call(torch.zeros(64), buffer, group=Group(1)) == "work"             # other memory: a copy to make
    assert call(buffer[:32], buffer, group=Group(1)) == "work"                 # same start, shorter
    assert call(shard, buffer, group=Group(1), async_op=True) == "work"        # the caller waits on a handle
    assert [c[2:4] for c in calls] == [(2, False), (2, False), (1, False), (1, False), (1, True)]
    assert calls[0][4] == {"op": "sum"}


def test_installing_twice_wraps_once():
    from megatron.core.distributed import param_and_grad_buffer as buffers

    skip_one_rank_gathers()
    first = (buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func)
    skip_one_rank_gathers()
    assert (buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func) == first
    assert all(not isinstance(f.collective, UnlessIdentity) for f in first)
    assert all(isinstance(f, UnlessIdentity) for f in first)
