"""How often a worker sends a stream's next chunk: the serving path's share of a CPU host.

Every chunk crosses the worker's Ray generator, the ingress and the gRPC/HTTP front end:
a few milliseconds of CPU in three processes. On a CPU host those milliseconds come out of
the engine's compute threads (an OpenMP step waits for its slowest thread), so one chunk per
engine step per stream costs 20-25% of the throughput at 8 streams on 2 cores
(docs/benchmarks.md). Pacing bounds that share: a worker's streams share `chunks_per_s`
chunks per second, but no stream's chunk waits longer than `max_interval_s`.
The first chunk (TTFT) and the last (end of stream) are never held back. GPU workers, whose
hosts have cores to spare, send every step.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO_CHUNKS_PER_S = 25.0
AUTO_MAX_INTERVAL_S = 0.25


@dataclass(frozen=True)
class StreamPacing:
    fixed_s: float | None  # a configured interval (0 = every engine step); None = automatic
    chunks_per_s: float = AUTO_CHUNKS_PER_S
    max_interval_s: float = AUTO_MAX_INTERVAL_S

    @classmethod
    def from_config(cls, interval_ms: float | None, on_gpu: bool) -> StreamPacing:
        if interval_ms is None and on_gpu:
            return cls(0.0)
        return cls(None if interval_ms is None else interval_ms / 1000.0)

    def interval(self, streams: int) -> float:
        """Seconds between two chunks of one stream while `streams` are being served."""
        if self.fixed_s is not None:
            return self.fixed_s
        return min(self.max_interval_s, max(1, streams) / self.chunks_per_s)
