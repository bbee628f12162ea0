"""When speculation pays, and how far: each step's proposal lengths, from each stream's
recent acceptance and the step's measured cost.

Speculating turns a step of T rows into one of T + D rows that emits, besides the T streams'
own tokens, the accepted part of the D proposals. It pays when the expected tokens per second
rise: (B + gain(D)) / cost(T + D) > B / cost(T). Both sides are measured here:

- **Acceptance** (`SpecState`): per stream, the chance that a proposed token is accepted
  given the ones before it were, from its recent verifications (a decaying count, with a
  prior of one half). The i-th proposal of a stream is then worth alpha^i expected tokens. A
  proposer whose proposals cost nothing (n-gram) also keeps proposing for streams that do not
  speculate, and scores those proposals against the tokens that follow (`shadow`), so a
  stream whose text turns repetitive starts speculating without a probe; a draft model is
  probed with one token every `PROBE_EVERY` steps instead.
- **Cost** (`StepCost`): the step's seconds as a linear model of three measured features:
  the forward time of T rows (timed at start-up, one forward per row count: on the CPU the
  `int8` linears take rows in passes of 64 and `exact` changes kernels past 16, so the cost
  is far from linear in T), the keys the rows' attention reads, and the rows sampled at random. The
  weights are fitted online (recursive least squares with forgetting) on the engine's own
  decode steps, so they follow the context lengths and the host as they change.

The proposals of a step are chosen greedily by value (alpha^i of every stream's next
proposal) and the count D that maximises the expected rate is kept; a step speculates only
when that rate beats plain decoding's by `MARGIN`. `disable_by_batch_size` turns it off
outright for steps with that many running streams (vLLM's rule).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# acceptance prior: one half, worth this many observations
PRIOR_TRIALS = 2.0
# each verification's weight decays by this much per later one (memory of ~10 verifications)
DECAY = 0.9
# a costly proposer re-tries a stream that stopped speculating this often (steps)
PROBE_EVERY = 16
# a step speculates only when its expected rate beats plain decoding's by this much: the
# cost model's error must not turn a small gain into a loss
MARGIN = 0.03
# the cost model's forgetting factor per observed step
FORGET = 0.98
# feature scales (the weights are then of order one): keys read per 1e6, random rows per 1e3
KEY_SCALE, SAMPLE_SCALE = 1e-6, 1e-3


@dataclass(slots=True)
class SpecState:
    """One stream's acceptance record and its unverified (shadow) proposal."""

    hits: float = PRIOR_TRIALS / 2
    trials: float = PRIOR_TRIALS
    shadow_at: int = -1  # the stream's length when `shadow` was proposed (-1: none)
    shadow: list[int] = field(default_factory=list)
    idle: int = 0  # steps since it last speculated

    @property
    def alpha(self) -> float:
        return self.hits / self.trials

    def observe(self, proposed: int, accepted: int) -> None:
        """`accepted` of `proposed` tokens were accepted: `accepted` successes in as many
        trials as were decided (the first rejection ends them)."""
        self.hits = self.hits * DECAY + accepted
        self.trials = self.trials * DECAY + min(accepted + 1, proposed)

    def resolve_shadow(self, ids: list[int]) -> None:
        """Score the shadow proposal once the tokens that followed it decide it."""
        at = self.shadow_at
        if at < 0 or len(ids) <= at:
            return
        prop = self.shadow
        got = ids[at : at + len(prop)]
        a = 0
        while a < len(got) and got[a] == prop[a]:
            a += 1
        if a < len(got) or len(got) == len(prop):  # a mismatch seen, or all of it matched
            self.observe(len(prop), a)
            self.shadow_at, self.shadow = -1, []


class StepCost:
    """A step's seconds: w . [lin(T), keys * KEY_SCALE, random rows * SAMPLE_SCALE], with
    lin(T) the forward time of T rows timed at start-up and w fitted online."""

    def __init__(self, grid: list[int], seconds: list[float], sample_row_s: float = 0.0) -> None:
        order = np.argsort(grid)
        self.grid = np.asarray(grid, np.float64)[order]
        self.lin_s = np.maximum(np.asarray(seconds, np.float64)[order], 1e-6)
        # the same as Python floats: a step observes one point, where numpy's per-call
        # overhead would cost a fast CPU step several percent
        self._g, self._s = self.grid.tolist(), self.lin_s.tolist()
        self.w = np.array([1.0, 0.0, sample_row_s / SAMPLE_SCALE])
        # the prior's covariance: the forward's scale is known within a factor, the keys'
        # weight not at all (learnt from the steps), the sampler's within a factor
        self.P = np.diag([0.5, 100.0, max(1.0, (self.w[2] ** 2))])
        self.observed = 0

    def lin(self, tokens: int | np.ndarray) -> np.ndarray | float:
        """Forward seconds of `tokens` rows: interpolated, and linear past the last point."""
        if isinstance(tokens, (int, float)):
            return self._lin1(float(tokens))
        g, s = self.grid, self.lin_s
        t = np.asarray(tokens, np.float64)
        out = np.interp(t, g, s)
        if len(g) > 1:
            slope = (s[-1] - s[-2]) / max(1.0, g[-1] - g[-2])
            out = np.where(t > g[-1], s[-1] + (t - g[-1]) * slope, out)
        return out if out.ndim else float(out)

    def _lin1(self, t: float) -> float:
        g, s = self._g, self._s
        if t <= g[0]:
            return s[0]
        if t >= g[-1]:
            if len(g) == 1:
                return s[0]
            return s[-1] + (t - g[-1]) * (s[-1] - s[-2]) / max(1.0, g[-1] - g[-2])
        i = bisect.bisect_right(g, t)
        return s[i - 1] + (s[i] - s[i - 1]) * (t - g[i - 1]) / (g[i] - g[i - 1])

    def features(self, tokens: int | np.ndarray, keys: float | np.ndarray,
                 random_rows: float | np.ndarray) -> np.ndarray:
        return np.stack(np.broadcast_arrays(self.lin(tokens), np.asarray(keys, np.float64) * KEY_SCALE,
                                            np.asarray(random_rows, np.float64) * SAMPLE_SCALE), -1)

    def predict(self, tokens: int | np.ndarray, keys: float | np.ndarray,
                random_rows: float | np.ndarray) -> np.ndarray:
        return np.maximum(self.features(tokens, keys, random_rows) @ self.w, 1e-6)

    def observe(self, tokens: int, keys: float, random_rows: int, seconds: float) -> None:
        """A decode step's measured seconds (recursive least squares with forgetting), in
        Python floats: three weights, once per step."""
        x = (self._lin1(float(tokens)), float(keys) * KEY_SCALE, float(random_rows) * SAMPLE_SCALE)
        P, w = self.P.tolist(), self.w.tolist()
        px = [P[i][0] * x[0] + P[i][1] * x[1] + P[i][2] * x[2] for i in range(3)]
        denom = FORGET + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
        gain = [v / denom for v in px]
        err = seconds - (x[0] * w[0] + x[1] * w[1] + x[2] * w[2])
        w = [w[i] + gain[i] * err for i in range(3)]
        w[0] = max(w[0], 0.05)  # a forward never costs nothing
        w[1], w[2] = max(w[1], 0.0), max(w[2], 0.0)
        P = [[(P[i][j] - gain[i] * px[j]) / FORGET for j in range(3)] for i in range(3)]
        trace = P[0][0] + P[1][1] + P[2][2]
        if trace > 1e4:  # directions the steps do not excite must not grow without bound
            P = [[v * 1e4 / trace for v in row] for row in P]
        self.w, self.P = np.array(w), np.array(P)
        self.observed += 1


@dataclass
class Candidate:
    """A decode-ready stream the policy may give proposals: its acceptance, context length,
    whether it samples at random, and how many proposals it can take."""

    alpha: float
    context: int
    random: bool
    room: int


class SpecPolicy:
    def __init__(self, k: int, disable_by_batch_size: int | None, cost: StepCost,
                 proposal_cost: Callable[[list[int]], float]) -> None:
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.cost = cost
        self.proposal_cost = proposal_cost
        # steps without speculation, by reason: batch size, or not expected to pay
        self.off_batch = 0
        self.off_cost = 0
        self.last_off: str | None = None  # why the last step did not speculate ("batch", "cost")
        # every proposal is verified whatever it costs (tests and benches of the verify path)
        self.always = False

    def lengths(self, cands: list[Candidate], running: int, other_tokens: int,
                other_keys: int) -> list[int]:
        """Proposal lengths for `cands` this step; `running` streams run in all, and the rest
        of the step computes `other_tokens` rows reading `other_keys` keys."""
        n = len(cands)
        self.last_off = None
        if not n:
            return []
        if self.disable_by_batch_size is not None and running >= self.disable_by_batch_size:
            self.off_batch += 1
            self.last_off = "batch"
            return [0] * n
        if self.always:
            return [min(self.k, c.room) for c in cands]
        # every stream's i-th proposal is worth alpha^i; take them best first
        vals: list[tuple[float, int, int]] = []
        for j, c in enumerate(cands):
            v = 1.0
            for i in range(1, min(self.k, c.room) + 1):
                v *= c.alpha
                if v < 0.01:
                    break
                vals.append((v, j, i))
        if not vals:
            self.off_cost += 1
            self.last_off = "cost"
            return [0] * n
        vals.sort(key=lambda t: -t[0])
        b = n
        base_rows = other_tokens + n
        base_keys = other_keys + sum(c.context for c in cands)
        base_random = sum(c.random for c in cands)
        gain = np.cumsum([0.0] + [v for v, _, _ in vals])
        d = np.arange(len(vals) + 1)
        keys = base_keys + np.cumsum([0] + [cands[j].context + i for _, j, i in vals])
        rand = base_random + np.cumsum([0] + [int(cands[j].random) for _, j, _ in vals])
        seconds = self.cost.predict(base_rows + d, keys, rand)
        # a draft model's steps: proposing the j-th token for that many streams
        extra = np.zeros(len(d))
        if self.proposal_cost is not None:
            rows = [0] * self.k
            for t, (_, _, i) in enumerate(vals, start=1):
                rows[i - 1] += 1
                extra[t] = self.proposal_cost(rows)
        rate = (b + gain) / (seconds + extra)
        best = int(np.argmax(rate))
        if best == 0 or rate[best] < rate[0] * (1 + MARGIN):
            self.off_cost += 1
            self.last_off = "cost"
            return [0] * n
        out = [0] * n
        for _, j, i in vals[:best]:
            out[j] = max(out[j], i)
        return out
