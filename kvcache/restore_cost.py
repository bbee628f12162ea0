"""Restore by copy or recompute, whichever is cheaper on this machine.

A parked stream's KV comes back either by copy from the host tier or by recomputing it
(prefill). The host tier only pays off where the copy is the cheaper of the two, and on a
fast GPU behind a slow link it is not, so the choice is measured rather than assumed:

- copy cost: bytes / the measured bandwidth of that direction + a fixed latency per copy;
- recompute cost: tokens / the measured prefill rate (tokens per second).

Both are measured once at start-up (`ModelRunner.calibrate`: a short timed copy of a few
blocks each way, a timed prefill chunk) and kept current by an exponential moving average of
the real copies (`BlockCopier` times them) and of the real steps that carry prompt tokens.

The same rule gates every host-tier copy that only pays off when a later copy back beats
recomputing: a write-back on eviction and a demotion of a reused prefix block (both
directions: out now, in later) and a restore or host prefix hit (host to device only, the
write-back is already paid). `policy` "copy" or "recompute" forces the choice (tests, benches).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

POLICIES = ("cost", "copy", "recompute")
# why a parked stream came back the way it did: (decision, reason)
DECISIONS = (
    ("copy", "cheaper_to_copy"),
    ("copy", "policy"),
    ("copy", "unmeasured"),  # no figures yet (a host tier used without calibration)
    ("recompute", "cheaper_to_recompute"),
    ("recompute", "policy"),
    ("recompute", "not_on_host"),  # the host holds none of what the device lost
)
DIRECTIONS = ("out", "in")  # device -> host, host -> device


def stat_key(decision: str, reason: str) -> str:
    """The `LLMEngine.stats()` key counting one (decision, reason)."""
    return f"restores_{decision}_{reason}"


def host_tier_summary(stats: Mapping[str, float], policy: str) -> dict[str, object]:
    """A worker's cost model and choices from its engine stats (`GetServerInfo`)."""
    return {
        "restore_policy": policy,
        "copy_gbps_d2h": float(stats.get("host_copy_gbps_d2h", 0.0)),
        "copy_gbps_h2d": float(stats.get("host_copy_gbps_h2d", 0.0)),
        "prefill_tokens_per_s": float(stats.get("prefill_tokens_per_s", 0.0)),
        "restores": {f"{d}/{r}": int(stats.get(stat_key(d, r), 0)) for d, r in DECISIONS},
        "writebacks_skipped": int(stats.get("writebacks_skipped", 0)),
    }


@dataclass(frozen=True, slots=True)
class Choice:
    copy: bool
    reason: str

    @property
    def decision(self) -> str:
        return "copy" if self.copy else "recompute"


class RestoreCost:
    """Copy and prefill figures, and the choice between them."""

    # weight of the newest observation in the moving averages
    ALPHA = 0.2

    def __init__(self, bytes_per_token: float, policy: str = "cost") -> None:
        if policy not in POLICIES:
            raise ValueError(f"host restore policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.bytes_per_token = bytes_per_token
        self.s_per_byte: dict[str, float | None] = dict.fromkeys(DIRECTIONS)
        self.latency_s: dict[str, float] = dict.fromkeys(DIRECTIONS, 0.0)
        self.s_per_token: float | None = None  # prefill

    # ---- figures -------------------------------------------------------------------------
    def set_copy(self, direction: str, s_per_byte: float, latency_s: float) -> None:
        """The start-up measurement of one direction."""
        self.s_per_byte[direction] = max(s_per_byte, 1e-15)
        self.latency_s[direction] = max(latency_s, 0.0)

    def observe_copy(self, direction: str, nbytes: int, seconds: float) -> None:
        """A real copy into the averages: one whose bytes take longer than the fixed latency
        updates the bandwidth (its time less the latency, per byte), a smaller one the
        latency (its time less its bytes' share), so many one-block copies cannot pass
        their overhead off as low bandwidth."""
        if nbytes <= 0 or seconds <= 0:
            return
        per_byte, latency = self.s_per_byte[direction], self.latency_s[direction]
        if per_byte is None:
            self.s_per_byte[direction] = seconds / nbytes
            return
        transfer = nbytes * per_byte
        if transfer >= latency:
            sample = max(seconds - latency, 0.5 * seconds) / nbytes
            self.s_per_byte[direction] = per_byte + self.ALPHA * (sample - per_byte)
        else:
            self.latency_s[direction] = latency + self.ALPHA * (max(seconds - transfer, 0.0) - latency)

    def set_prefill(self, tokens: int, seconds: float) -> None:
        """The start-up measurement: a timed prefill chunk."""
        self.s_per_token = None
        self.observe_prefill(tokens, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward that computed `tokens` tokens (start-up chunk or a real step)."""
        if tokens <= 0 or seconds <= 0:
            return
        sample = seconds / tokens
        old = self.s_per_token
        self.s_per_token = sample if old is None else old + self.ALPHA * (sample - old)

    @property
    def measured(self) -> bool:
        return self.s_per_token is not None and all(v is not None for v in self.s_per_byte.values())

    def gbps(self, direction: str) -> float:
        s = self.s_per_byte[direction]
        return 1e-9 / s if s else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.s_per_token if self.s_per_token else 0.0

    # ---- costs and choices ---------------------------------------------------------------
    def copy_s(self, tokens: int, directions: tuple[str, ...] = ("in",)) -> float:
        nbytes = tokens * self.bytes_per_token
        return sum(self.latency_s[d] + nbytes * (self.s_per_byte[d] or 0.0) for d in directions)

    def recompute_s(self, tokens: int) -> float:
        return tokens * (self.s_per_token or 0.0)

    def choose(self, tokens: int, round_trip: bool = False) -> Choice:
        """Copy `tokens` tokens' KV (host to device; with `round_trip` also device to host
        first) or recompute them, whichever costs less; ties go to recompute (no copy)."""
        if self.policy != "cost":
            return Choice(self.policy == "copy", "policy")
        if not self.measured:
            return Choice(True, "unmeasured")
        dirs = DIRECTIONS if round_trip else ("in",)
        if self.copy_s(tokens, dirs) < self.recompute_s(tokens):
            return Choice(True, "cheaper_to_copy")
        return Choice(False, "cheaper_to_recompute")

    def figures(self) -> dict[str, float]:
        """What `LLMEngine.stats()` reports of the model (zeros where nothing is measured)."""
        return {
            "host_copy_gbps_d2h": self.gbps("out"),
            "host_copy_gbps_h2d": self.gbps("in"),
            "host_copy_latency_us_d2h": self.latency_s["out"] * 1e6,
            "host_copy_latency_us_h2d": self.latency_s["in"] * 1e6,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
        }
