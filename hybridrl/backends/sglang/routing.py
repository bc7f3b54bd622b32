"""Routing records of multi-turn episodes, sent once: what SGLang already returned, by token prefix.

An agent's turn t+1 sends the whole context again (turn t's prompt and output, then the observation),
and SGLang would return the routing of every position again (Qwen3-30B-A3B: ~1.5 KB a token, through
ZMQ and base64, decoded here), of which the trajectory keeps only the new rows. With
`routed_experts_start_len=s` SGLang returns the rows of positions [s, seqlen - 1) only (sglang 0.5.21
managers/io_struct.py:262-265, managers/scheduler_components/batch_result_processor.py:153-160; at most
the prompt's length, managers/scheduler.py:3089-3099). This memory keeps the record of each finished
request by its tokens (prompt + output); a later prompt that extends one of them asks for the rows
after it and gets back, joined, the same whole record as before: callers (the agent loop's trajectory
merge) see no difference. Forgotten at `clear()` (the engine's sleep: the end of a rollout phase) and
past `max_entries` (oldest first).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

KEY_TOKENS = 16          # sequences are found by their first tokens; shorter ones are not remembered


class RoutingMemory:
    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[tuple[int, ...], Any]] = OrderedDict()   # id -> (tokens, rows)
        self._by_key: dict[tuple[int, ...], list[int]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> tuple[int, Any, int | None]:
        """(start, rows, entry): the longest remembered sequence that `prompt` starts with, its record
        (`start` rows: every position of it but its last token) and its id; (0, None, None) when none."""
        best: tuple[int, Any, int | None] = (0, None, None)
        for entry in self._by_key.get(tuple(prompt[:KEY_TOKENS]), ()):
            tokens, rows = self._entries[entry]
            if len(rows) > best[0] and len(tokens) <= len(prompt) and tuple(prompt[:len(tokens)]) == tokens:
                best = (len(rows), rows, entry)
        return best

    def remember(self, tokens: Sequence[int], rows: Any, *, replaces: int | None = None) -> None:
        """The whole record `rows` of a finished request whose prompt + output is `tokens`; `replaces`: the
        entry it extends (found by `lookup`), no longer needed."""
        if replaces is not None and replaces in self._entries:
            self._drop(replaces)
        if len(tokens) < KEY_TOKENS or rows is None or len(rows) != len(tokens) - 1:
            return
        self._entries[self._next] = (tuple(tokens), rows)
        self._by_key.setdefault(tuple(tokens[:KEY_TOKENS]), []).append(self._next)
        self._next += 1
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, entry: int) -> None:
        tokens, _ = self._entries.pop(entry)
        key = tuple(tokens[:KEY_TOKENS])
        self._by_key[key].remove(entry)
        if not self._by_key[key]:
            del self._by_key[key]

    def clear(self) -> None:
        self._entries.clear()
        self._by_key.clear()


def joined(known: Any, new: Any) -> Any:
    """The whole record: the remembered rows, then the ones SGLang returned after them."""
    import torch

    if known is None or len(known) == 0:
        return new
    if new is None:
        return known
    return torch.cat([known, new])
