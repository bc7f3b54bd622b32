"""Generation latency and batching samples, from the engine's own per-token timestamps.

Series (each a bounded ring of the latest samples and a cumulative count; `snapshot` is what
`EngineCore.stats()["latency"]` reports, and the controller takes the samples newer than the count it
last saw to compute a step's percentiles, `controller/metrics.py`):
- ttft_s: per request, submit -> its first output token emitted (queueing and prefill included);
- itl_s: per output token after the first, the time since the previous token of its request was
  emitted (a token verified in the same step as the previous one, speculative decoding, counts 0;
  a preempted request's wait counts where it resumes);
- batch_size: per step, the sequences it computes (decodes and prefill chunks);
- batch_utilisation: per step, running sequences / rollout.native.max_num_seqs.
Timestamps are `time.monotonic()` at the end of the step that emitted the token (`Sequence.token_times`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

SERIES = ("ttft_s", "itl_s", "batch_size", "batch_utilisation")


class LatencyLog:
    def __init__(self, maxlen: int = 16384):
        self.recent: dict[str, deque[float]] = {name: deque(maxlen=maxlen) for name in SERIES}
        self.count: dict[str, int] = dict.fromkeys(SERIES, 0)

    def add(self, name: str, value: float) -> None:
        self.recent[name].append(value)
        self.count[name] += 1

    def record_token(self, seq: Any, now: float) -> None:
        """An output token of `seq` (a scheduler `Sequence`) was emitted at `now`."""
        if seq.token_times:
            self.add("itl_s", now - seq.token_times[-1])
        else:
            seq.t_first_token = now
            self.add("ttft_s", now - seq.t_submit)
        seq.token_times.append(now)

    def record_step(self, batch_size: int, utilisation: float) -> None:
        self.add("batch_size", float(batch_size))
        self.add("batch_utilisation", utilisation)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: {"count": self.count[name], "recent": list(self.recent[name])} for name in SERIES}
