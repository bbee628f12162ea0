"""Batched next-token sampling on the logits' device.

Order of operations for each row (every step is vectorized over the rows that need it and
skipped entirely when none does):

1. bans: EOS ids (ignore_eos, or fewer than min_tokens generated) and, below min_tokens,
   the request's stop_token_ids are set to -inf;
2. penalties: repetition (HF/vLLM: over prompt + output tokens, a positive logit is divided
   by the penalty and a negative one multiplied), then frequency and presence (OpenAI: over
   output tokens only, `logit -= frequency * count + presence * (count > 0)`);
3. logprobs are taken here, from log_softmax of the penalized logits: the model's own
   distribution as the request's penalties and bans shaped it, but before temperature and
   top-k/top-p/min-p, which are choices of how to draw rather than of what the model thinks
   (vLLM likewise returns unprocessed logprobs by default);
4. greedy rows take the argmax; random rows divide by temperature, apply top-k, top-p,
   min-p, and draw with the exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. picks
   token i with probability p_i. A seeded row draws its q from its own generator, one fixed-size
   draw per step, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.sampling import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # chosen token's logprob, for every row once any row asked for logprobs; else None
    logprobs: list[float] | None
    # per row, top-n (id, logprob) best first; an empty list for rows that did not ask;
    # None if no row asked for n >= 1
    top_logprobs: list[list[tuple[int, float]]] | None


class SampledBatch:
    """A step's sampled ids, still on the logits' device (`tokens`, the next step's inputs
    under asynchronous scheduling), with their copy to the host started: `result()` waits
    for that copy only, never for work queued after it."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor | None = None,
                 wants: list[int | None] | None = None) -> None:
        self.tokens = tokens
        src = tokens if packed is None else packed
        self._event = None
        if src.is_cuda:  # one non-blocking copy into pinned memory, waited for in result()
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._host.copy_(src, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = src
        self._packed = packed is not None
        self._wants = wants or []

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        host = self._host
        if not self._packed:
            return SamplerOutput(host.tolist(), None, None)
        B = self.tokens.shape[0]
        n_max = (host.shape[0] - 2 * B) // (2 * B) if B else 0
        token_list = host[:B].long().tolist()
        chosen_list = host[B : 2 * B].tolist()
        top: list[list[tuple[int, float]]] | None = None
        if n_max > 0:
            vals_l = host[2 * B : 2 * B + B * n_max].view(B, n_max).tolist()
            ids_l = host[2 * B + B * n_max :].view(B, n_max).long().tolist()
            top = [
                list(zip(ids_l[i][:n], vals_l[i][:n], strict=True)) if n else []
                for i, n in enumerate(self._wants)
            ]
        return SamplerOutput(token_list, chosen_list, top)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator for `seed` on `device`, or None for unseeded requests."""
    if seed is None:
        return None
    g = torch.Generator(device=torch.device(device))
    # manual_seed takes 64-bit values only; any Python int the client sent maps into range.
    g.manual_seed(seed % (1 << 64))
    return g


class Sampler:
    """Turns a batch of logits into next tokens; holds only the shared generator(s)."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        # One shared generator per device, made on first use (the logits decide the device).
        self._shared: dict[torch.device, torch.Generator] = {}

    def shared_generator(self, device: torch.device) -> torch.Generator:
        g = self._shared.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self._seed % (1 << 64))
            self._shared[device] = g
        return g

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[int] | None = None,
    ) -> SamplerOutput:
        """Pick one token per row of `logits` (see `sample`); waits for the ids."""
        return self.sample(logits, params, prompt_ids, output_ids, generators, eos_token_ids).result()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[int] | None = None,
    ) -> SampledBatch:
        """Pick one token per row of `logits`; the ids stay on its device until read.

        `generators[i]` is row i's own generator (see make_generator), made once per request
        and passed again every step; rows with None draw from this sampler's shared one.
        `eos_token_ids` are banned for rows with ignore_eos or still short of min_tokens.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        if not (len(params) == len(prompt_ids) == len(output_ids) == len(generators) == B):
            raise ValueError(
                f"batch of {B} logits rows but {len(params)} params, {len(prompt_ids)} "
                f"prompts, {len(output_ids)} outputs, {len(generators)} generators"
            )
        device = logits.device
        if _plain_greedy(params):
            # the common serving case: one argmax and one device-to-host copy for the batch
            bans = _ban_lists(params, output_ids, eos_token_ids or (), V)
            if device.type == "cpu" and logits.dtype == torch.float32:
                return SampledBatch(_greedy_cpu(logits, bans))
            if bans is None:
                return SampledBatch(logits.argmax(dim=-1))
            eos_rows, eos_cols, rows, _ = bans
            if len(eos_rows) == B and not rows:  # e.g. every row ignores EOS: one masked copy
                x = logits.index_fill(1, torch.tensor(eos_cols, device=device), -float("inf"))
            else:
                x = torch.empty((B, V), dtype=torch.float32, device=device)
                x.copy_(logits)
                _set_bans(x, bans)
            return SampledBatch(x.argmax(dim=-1))
        # A contiguous float32 copy: penalties write in place through a flat view and must not
        # touch the caller's tensor, and half-precision softmax/cumsum is too coarse for top-p.
        x = torch.empty((B, V), dtype=torch.float32, device=device)
        x.copy_(logits)

        _apply_bans(x, params, output_ids, eos_token_ids or ())
        _apply_penalties(x, params, prompt_ids, output_ids)

        want_lp = [p.logprobs is not None for p in params]
        logp = torch.log_softmax(x, dim=-1) if any(want_lp) else None

        tokens = _choose(x, params, generators, self.shared_generator(device))

        if logp is None:
            return SampledBatch(tokens)
        # everything the host needs comes back in one device-to-host copy (float64 holds
        # token ids exactly)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        n_max = min(max((p.logprobs or 0) for p in params), V)
        parts = [tokens.double(), chosen.double()]
        if n_max > 0:
            # One top-k for the widest request; each row keeps its own prefix.
            vals, ids = logp.topk(n_max, dim=-1)
            parts += [vals.double().flatten(), ids.double().flatten()]
        return SampledBatch(tokens, torch.cat(parts), [min(p.logprobs or 0, n_max) for p in params])


_Bans = tuple[list[int], list[int], list[int], list[int]]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax (first maximum, as torch's); float32 on the CPU through numpy, several
    times faster there than torch's reduction."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.contiguous().numpy().argmax(-1))
    return x.argmax(dim=-1)


def _greedy_cpu(logits: torch.Tensor, bans: _Bans | None) -> torch.Tensor:
    """Greedy ids on the CPU without copying the logits: the argmax first, then only rows
    whose best token is banned are redone with their bans masked."""
    x = logits.contiguous().numpy()
    best = x.argmax(-1)
    if bans is None:
        return torch.from_numpy(best)
    eos_rows, eos_cols, rows, cols = bans
    ec = np.asarray(eos_cols, np.int64)
    r1, c1 = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    hit: set[int] = set()
    if len(eos_rows) == len(best):  # every row bans EOS (e.g. ignore_eos)
        hit.update(np.flatnonzero((best[:, None] == ec).any(1)).tolist())
    elif eos_rows:
        er = np.asarray(eos_rows, np.int64)
        hit.update(er[(best[er, None] == ec).any(1)].tolist())
    if r1.size:
        hit.update(r1[best[r1] == c1].tolist())
    if hit:
        eos_set = set(eos_rows)
        for i in hit:
            row = x[i].copy()
            if i in eos_set:
                row[ec] = -np.inf
            row[c1[r1 == i]] = -np.inf
            best[i] = row.argmax()
    return torch.from_numpy(best)


def _plain_greedy(params: Sequence[SamplingParams]) -> bool:
    """Every row is greedy with no penalties and no logprobs (bans are allowed)."""
    last = None
    for p in params:
        if p is last:  # requests of one generate() call share their params
            continue
        last = p
        if (not p.greedy or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            return False
    return True


def _ban_lists(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    V: int,
) -> _Bans | None:
    """(rows banning every EOS id, those ids, then single (row, token) bans), or None if
    nothing is banned. Ids outside this model's vocab cannot be produced anyway."""
    eos_rows: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    uniq = dict(zip(map(id, params), params, strict=True)).values() if len(params) > 8 else params
    if not any(p.min_tokens for p in uniq):  # the common case: no per-row length test
        if all(p.ignore_eos for p in uniq):
            eos_rows = list(range(len(params)))
        elif any(p.ignore_eos for p in uniq):
            eos_rows = [i for i, p in enumerate(params) if p.ignore_eos]
        params = ()
    for i, p in enumerate(params):
        if len(output_ids[i]) < p.min_tokens:
            eos_rows.append(i)
            # vLLM semantics: min_tokens also holds back the request's own stop tokens.
            for t in p.stop_token_ids:
                if 0 <= t < V:
                    rows.append(i)
                    cols.append(t)
        elif p.ignore_eos:
            eos_rows.append(i)
    eos_cols = [t for t in eos_token_ids if 0 <= t < V] if eos_rows else []
    if not eos_cols:
        eos_rows = []
    if not eos_rows and not rows:
        return None
    return eos_rows, eos_cols, rows, cols


def _set_bans(x: torch.Tensor, bans: _Bans) -> None:
    """Set banned (row, token) logits to -inf in place: EOS ids in one broadcast write."""
    eos_rows, eos_cols, rows, cols = bans
    dev = x.device
    if eos_rows:
        c = torch.tensor(eos_cols, device=dev)
        if len(eos_rows) == x.shape[0]:
            x[:, c] = -float("inf")
        else:
            x[torch.tensor(eos_rows, device=dev).unsqueeze(1), c] = -float("inf")
    if rows:
        x[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = -float("inf")


def _apply_bans(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
) -> None:
    """Set banned (row, token) logits to -inf in place."""
    bans = _ban_lists(params, output_ids, eos_token_ids, x.shape[1])
    if bans is not None:
        _set_bans(x, bans)


def _flat_positions(rows: Sequence[int], id_lists: Sequence[Sequence[int]], V: int) -> torch.Tensor:
    """Flat positions `row * V + token` (CPU, repeats kept) of the given rows' tokens.

    Penalties then touch only these positions, O(tokens) rather than O(batch * vocab), and a
    flat list beats a padded [B, L] id tensor when one long prompt sits among short ones.
    Ids outside [0, V) are dropped.
    """
    lens = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    toks = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lens)
    keep = (toks >= 0) & (toks < V)
    return row[keep] * V + toks[keep]


def _apply_penalties(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> None:
    """Repetition, then frequency and presence penalties, in place on contiguous `x`."""
    V = x.shape[1]
    dev = x.device
    flat = x.view(-1)
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        ids = [list(prompt_ids[i]) + list(output_ids[i]) for i in rep_rows]
        # Repeated positions are fine here: each write stores the same value.
        keys = _flat_positions(rep_rows, ids, V).to(dev)
        per_row = torch.tensor([p.repetition_penalty for p in params], device=dev)
        pen = per_row[keys // V]
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / pen, vals * pen)

    pf_rows = [
        i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if pf_rows:
        pos = _flat_positions(pf_rows, [output_ids[i] for i in pf_rows], V)
        keys, counts = (t.to(dev) for t in torch.unique(pos, return_counts=True))
        row = keys // V
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[row]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[row]
        flat[keys] -= freq * counts.to(torch.float32) + pres


def _choose(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator,
) -> torch.Tensor:
    """Next token per row: argmax for greedy rows, a filtered random draw for the others."""
    tokens = _argmax(x)
    rand_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rand_rows:
        return tokens
    dev = x.device
    R, V = len(rand_rows), x.shape[1]
    rp = [params[i] for i in rand_rows]
    idx = torch.tensor(rand_rows, device=dev)
    z = x[idx]  # a copy: the filters below write in place
    z.div_(torch.tensor([p.temperature for p in rp], device=dev).unsqueeze(1))
    _top_k(z, [p.top_k if 0 < p.top_k < V else V for p in rp])  # -1 / 0 / >= V: off
    _top_p(z, [p.top_p for p in rp])

    probs = torch.softmax(z, dim=-1)
    min_p = [p.min_p for p in rp]
    if any(m > 0.0 for m in min_p):
        thresh = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < thresh, 0.0)

    q = torch.empty(R, V, device=dev)
    own = [j for j, i in enumerate(rand_rows) if generators[i] is not None]
    rest = [j for j, i in enumerate(rand_rows) if generators[i] is None]
    for j in own:
        # Exactly V draws per step from the row's own generator, independent of the batch.
        q[j].uniform_(generator=generators[rand_rows[j]])
    if rest:
        q[torch.tensor(rest, device=dev)] = torch.empty(len(rest), V, device=dev).uniform_(
            generator=shared
        )
    # Exp(1) noise as -log(U): on CPU about 2.5x faster than exponential_. U = 0 gives +inf,
    # which only makes that token lose; the clamp keeps q > 0 should U round to 1, since
    # 0/0 = NaN would win argmax.
    q.log_().neg_().clamp_min_(torch.finfo(q.dtype).tiny)
    tokens[idx] = _argmax(probs / q)
    return tokens


# Top-p first looks for each row's nucleus among this many likeliest tokens, a partial top-k
# far cheaper than sorting a 100k+ vocab; only rows whose nucleus is wider get a full sort.
_TOP_P_CANDIDATES = 1024


def _top_k(z: torch.Tensor, ks: list[int]) -> None:
    """Mask (to -inf, in place) logits below each row's k-th largest; k == V means off.

    A threshold rather than a positional cut: ties with the k-th value are all kept, so the
    result depends only on the row's values, never on tie order or on the rest of the batch.
    """
    V = z.shape[1]
    rows = [j for j, k in enumerate(ks) if k < V]
    if not rows:
        return
    whole = len(rows) == len(ks)
    sub = z if whole else z[torch.tensor(rows, device=z.device)]
    k_t = torch.tensor([ks[j] for j in rows], device=z.device).unsqueeze(1)
    kth = sub.topk(int(k_t.max()), dim=-1).values.gather(1, k_t - 1)
    sub.masked_fill_(sub < kth, -float("inf"))
    if not whole:
        z[torch.tensor(rows, device=z.device)] = sub


def _top_p(z: torch.Tensor, ps: list[float]) -> None:
    """Mask (to -inf, in place) tokens outside each row's nucleus; p == 1 means off.

    The nucleus is the smallest set of likeliest tokens whose mass reaches p: a token is kept
    while the mass strictly before it is below p, so the likeliest token always survives.
    """
    R, V = z.shape
    dev = z.device
    rows = [j for j, p in enumerate(ps) if p < 1.0]
    if not rows:
        return
    whole = len(rows) == R
    sub = z if whole else z[torch.tensor(rows, device=dev)]
    probs = torch.softmax(sub, dim=-1)
    p_t = torch.tensor([ps[j] for j in rows], device=dev).unsqueeze(1)

    vals, ids = probs.topk(min(V, _TOP_P_CANDIDATES), dim=-1)  # sorted, likeliest first
    cum = vals.cumsum(dim=-1)
    keep = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, ids, (cum - vals) < p_t)
    if vals.shape[1] < V:
        # Rows whose candidates hold less than p: their nucleus is wider, sort them fully.
        # (Whether a row is covered depends on its own values only, as do both paths.)
        wide = (cum[:, -1:] < p_t).squeeze(1).nonzero().squeeze(1)
        if wide.numel():
            s_vals, s_ids = probs[wide].sort(dim=-1, descending=True, stable=True)
            s_keep = (s_vals.cumsum(dim=-1) - s_vals) < p_t[wide]
            keep[wide] = torch.zeros_like(s_keep).scatter_(1, s_ids, s_keep)
    sub.masked_fill_(~keep, -float("inf"))
    if not whole:
        z[torch.tensor(rows, device=dev)] = sub
