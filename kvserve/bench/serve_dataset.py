"""The workload of `kvserve bench serve`: random / prefix-repetition prompts and arrival times.

Prompts start as random token ids (away from special tokens). Text prompts are those ids
decoded, then re-encoded and trimmed or extended until the text tokenizes to the target
length (decode/encode is not a round trip for random ids). Every request carries both the
text and its ids as the server's tokenizer sees them, so a client that sends text and the
in-process engine that takes ids process the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.bench.common import VOCAB_MARGIN

_FIX_ROUNDS = 10  # decode/encode rounds to hit the target length; random ids settle in 1-3


@dataclass
class BenchRequest:
    prompt: str  # the text sent to text-only APIs
    prompt_ids: list[int]  # what the server's tokenizer makes of `prompt`
    output_len: int
    session_id: str | None = None  # --skew: pins the request to one worker's session

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def sample_lens(n: int, mean: int, range_ratio: float, rng: np.random.Generator) -> list[int]:
    """`n` lengths uniform in [mean*(1-r), mean*(1+r)] (vLLM's --random-range-ratio), >= 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(mean * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1.0 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def _random_ids(n: int, vocab: int, rng: np.random.Generator) -> list[int]:
    lo = min(VOCAB_MARGIN, vocab // 4)
    return rng.integers(lo, max(lo + 1, vocab - lo), size=n).tolist()


def text_of_len(tok: Any, ids: list[int], target: int, rng: np.random.Generator) -> tuple[str, list[int]]:
    """Text that encodes (without special tokens) to exactly `target` ids where reachable,
    starting from the decode of `ids`; returns (text, its ids)."""
    vocab = tok.vocab_size
    text, got = "", []
    for _ in range(_FIX_ROUNDS):
        text = tok.decode(ids)
        got = tok.encode(text, add_special_tokens=False)
        if len(got) == target:
            break
        # trim the excess, or extend with fresh random ids, and try again
        ids = got[:target] if len(got) > target else got + _random_ids(target - len(got), vocab, rng)
    return text, got


def _request(tok: Any, text: str, output_len: int) -> BenchRequest:
    # the ids the server derives from the text: with the special tokens it adds (BOS)
    return BenchRequest(text, tok.encode(text), output_len)


def random_dataset(
    tok: Any, num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins = sample_lens(num, input_len, range_ratio, rng)
    outs = sample_lens(num, output_len, range_ratio, rng)
    reqs = []
    for n_in, n_out in zip(ins, outs, strict=True):
        text, _ = text_of_len(tok, _random_ids(n_in, tok.vocab_size, rng), n_in, rng)
        reqs.append(_request(tok, text, n_out))
    return reqs


def long_short_dataset(
    tok: Any, num: int, short_len: int, long_len: int, long_share: float, output_len: int,
    range_ratio: float, seed: int,
) -> list[BenchRequest]:
    """Short prompts that decode, and a share `long_share` of long prompts among them (in
    random order): long prompts arrive while the others decode, the workload disaggregated
    serving is for."""
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"--long-share must be in [0, 1], got {long_share}")
    rng = np.random.default_rng(seed)
    longs = set(rng.choice(num, size=round(long_share * num), replace=False).tolist())
    ins = sample_lens(num, short_len, range_ratio, rng)
    big = sample_lens(num, long_len, range_ratio, rng)
    outs = sample_lens(num, output_len, range_ratio, rng)
    reqs = []
    for i in range(num):
        n_in = big[i] if i in longs else ins[i]
        text, _ = text_of_len(tok, _random_ids(n_in, tok.vocab_size, rng), n_in, rng)
        reqs.append(_request(tok, text, outs[i]))
    return reqs


def prefix_repetition_dataset(
    tok: Any,
    num: int,
    prefix_len: int,
    num_prefixes: int,
    suffix_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    """`num` prompts, each one of `num_prefixes` shared prefixes plus its own random suffix,
    in random order: the prefix cache (and KV-affinity routing) can serve the shared part."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("--num-prefixes and --prefix-len must be >= 1")
    rng = np.random.default_rng(seed)
    vocab = tok.vocab_size
    prefixes = [
        text_of_len(tok, _random_ids(prefix_len, vocab, rng), prefix_len, rng)[0]
        for _ in range(num_prefixes)
    ]
    sufs = sample_lens(num, suffix_len, range_ratio, rng)
    outs = sample_lens(num, output_len, range_ratio, rng)
    reqs = []
    for i, (n_suf, n_out) in enumerate(zip(sufs, outs, strict=True)):
        suffix, _ = text_of_len(tok, _random_ids(n_suf, vocab, rng), n_suf, rng)
        reqs.append(_request(tok, prefixes[i % num_prefixes] + suffix, n_out))
    order = rng.permutation(num).tolist()
    return [reqs[i] for i in order]


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds after the start: gamma-distributed gaps with mean 1/rate and
    shape `burstiness` (1 = Poisson; < 1 burstier, > 1 more even); all 0 when rate is inf."""
    if burstiness <= 0 or not math.isfinite(burstiness):
        raise ValueError(f"--burstiness must be a positive number, got {burstiness}")
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"--request-rate must be > 0 (inf = all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    # the first request goes at once; each later one waits the gaps before it
    return np.concatenate(([0.0], np.cumsum(gaps[:-1]))).tolist() if num else []
