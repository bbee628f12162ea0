"""The router's Prometheus metrics, exported through `ray.util.metrics` (tag: the policy).

`kvserve_router_decisions` counts each successful pick by kind: the policy's "prefix"
decisions are split by where the matched prefix lives, `device_affinity` when the chosen
worker holds all of it in device memory (or had it routed there just now), else
`host_affinity` (some of it is only in its host tier).
"""

from __future__ import annotations

from kvserve.router.policy import Decision, WorkerView
from kvserve.workers.metrics import zero

# the decision kinds each policy can produce
POLICY_KINDS = {
    "affinity": ("device_affinity", "host_affinity", "session", "least_loaded"),
    "least_loaded": ("least_loaded",),
    "round_robin": ("round_robin",),
}


def decision_kind(d: Decision, chosen: WorkerView, block_hashes: list[int]) -> str:
    if d.reason != "prefix":
        return d.reason
    matched = block_hashes[: d.matched_blocks]
    on_device = all(h in chosen.held_device or h in chosen.pending for h in matched)
    return "device_affinity" if on_device else "host_affinity"


class RouterMetrics:
    def __init__(self, policy: str) -> None:
        from ray.util.metrics import Counter, Gauge

        tags = {"policy": policy}
        self.decisions = Counter(
            "kvserve_router_decisions", "successful routing decisions, by kind",
            tag_keys=("policy", "kind")).set_default_tags(tags)
        self.retries = Counter(
            "kvserve_router_retries",
            "picks for a request whose earlier worker died before its first token",
            tag_keys=("policy",)).set_default_tags(tags)
        self.alive = Gauge("kvserve_router_workers_alive", "workers the router routes to",
                           tag_keys=("policy",)).set_default_tags(tags)
        for kind in POLICY_KINDS.get(policy, ()):
            zero(self.decisions, {"kind": kind})
        zero(self.retries)

    def picked(self, d: Decision, chosen: WorkerView, block_hashes: list[int], retry: bool) -> None:
        self.decisions.inc(tags={"kind": decision_kind(d, chosen, block_hashes)})
        if retry:
            self.retries.inc()

    def workers_alive(self, views: list[WorkerView]) -> None:
        self.alive.set(sum(v.alive for v in views))

