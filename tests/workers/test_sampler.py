"""SamplingParams validation and the batched Sampler (workers/sampler.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvserve.errors import InvalidRequestError
from kvserve.sampling import SamplingParams, parse_sampling_params
from kvserve.workers.engine.sampler import Sampler, _apply_penalties, make_generator

SP = SamplingParams
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    *,
    sampler: Sampler | None = None,
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: list[int] | None = None,
):
    B = logits.shape[0]
    return (sampler or Sampler(seed=0))(
        logits,
        params,
        prompt_ids if prompt_ids is not None else [[] for _ in range(B)],
        output_ids if output_ids is not None else [[] for _ in range(B)],
        generators if generators is not None else [None] * B,
        eos_token_ids=eos,
    )


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field", "hint"),
    [
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"temperature": float("inf")}, "temperature", "finite"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"top_p": 0.0}, "top_p", "greater than 0"),
        ({"top_p": float("nan")}, "top_p", "finite"),
        ({"max_tokens": -3}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"top_k": -5}, "top_k", "-1 or 0"),
        ({"logprobs": 100}, "logprobs", "less than or equal to 20"),
        ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"bogus_field": 1}, "bogus_field", "unknown"),
        ({"n": 2}, "n", "only n=1"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "greater than 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"max_tokens": True}, "max_tokens", "boolean"),
        ({"stop": [""]}, "stop", "empty"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "max_tokens"),
    ],
)
def test_invalid_params_rejected_with_clear_message(kwargs, field, hint):
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)
    for build in (
        lambda: SamplingParams.validated(**kwargs),
        lambda: parse_sampling_params(kwargs),
    ):
        with pytest.raises(InvalidRequestError) as ei:
            build()
        msg = str(ei.value)
        assert isinstance(ei.value, ValueError)
        assert field in msg and hint in msg, msg
        assert "\n" not in msg


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_every_float_rejects_nan_and_inf(field, bad):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams.validated(**{field: bad})


def test_defaults_and_coercions():
    p = parse_sampling_params(None)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, -1, 1.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and p.n == 1
    assert not p.greedy
    assert SP(stop="###").stop == ["###"]
    assert SP(stop=None).stop == []
    assert SP(temperature=0).greedy and SP(top_k=1).greedy and not SP(top_k=0).greedy
    for k in (-1, 0, 1, 50):
        SP(top_k=k)
    with pytest.raises(InvalidRequestError, match="object"):
        parse_sampling_params([("temperature", 1.0)])  # type: ignore[arg-type]


def test_validate_assignment():
    p = SP()
    with pytest.raises(ValidationError):
        p.top_p = 2.0


@given(
    t=st.floats(0, 100),
    p=st.floats(0, 1, exclude_min=True),
    k=st.integers(-1, 1000),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
)
@settings(max_examples=60, deadline=None)
def test_valid_ranges_accepted(t, p, k, seed):
    sp = SamplingParams.validated(temperature=t, top_p=p, top_k=k, seed=seed)
    assert sp.temperature == t and sp.top_p == p
    g = make_generator(sp.seed, "cpu")
    assert (g is None) == (seed is None)


# --------------------------------------------------------------------------- greedy / filters


@given(
    B=st.integers(1, 6),
    V=st.integers(2, 50),
    seed=st.integers(0, 2**31),
    which=st.lists(st.booleans(), min_size=6, max_size=6),
)
@settings(max_examples=40, deadline=None)
def test_greedy_rows_are_argmax_in_mixed_batch(B, V, seed, which):
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3
    params = [SP(temperature=0.0) if which[i] else SP(temperature=1.5) for i in range(B)]
    out = run(logits, params)
    argmax = logits.argmax(-1).tolist()
    for i in range(B):
        if which[i]:
            assert out.token_ids[i] == argmax[i]
        assert 0 <= out.token_ids[i] < V


def test_top_k_1_equals_greedy_and_top_k_limits_support():
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * 2
    g = run(logits, [SP(temperature=0)] * 4).token_ids
    k1 = run(logits, [SP(temperature=2.0, top_k=1)] * 4).token_ids
    assert k1 == g == logits.argmax(-1).tolist()

    # top_k=2 at a high temperature: only the two best tokens ever, and both of them.
    row = torch.randn(1, 32, generator=torch.Generator().manual_seed(2))
    many = row.expand(2000, 32)
    toks = set(run(many, [SP(temperature=5.0, top_k=2)] * 2000).token_ids)
    assert toks == set(row[0].topk(2).indices.tolist())
    # With top-p on as well (the full-sort path) top-k must still hold.
    toks = set(run(many, [SP(temperature=5.0, top_k=3, top_p=0.999)] * 2000).token_ids)
    assert toks == set(row[0].topk(3).indices.tolist())


def test_top_k_only_on_some_rows():
    row = torch.randn(1, 32, generator=torch.Generator().manual_seed(4))
    N = 600
    params = [SP(temperature=5.0, top_k=2), SP(temperature=5.0), SP(temperature=5.0, top_k=0)] * N
    toks = run(row.expand(3 * N, 32), params).token_ids
    top2 = set(row[0].topk(2).indices.tolist())
    assert set(toks[0::3]) == top2
    assert len(set(toks[1::3])) > 10 and len(set(toks[2::3])) > 10  # k off: whole vocab


def test_top_p_with_nucleus_wider_than_candidate_window():
    # 4000 distinct, nearly flat logits: the 0.8 nucleus holds ~3200 tokens, beyond the
    # 1024-token candidate window, so the full-sort fallback must take over for that row,
    # while a peaked row in the same batch stays on the fast path.
    V, N = 4000, 400
    flat = torch.linspace(0.0, 0.5, V)
    peaked = torch.randn(V, generator=torch.Generator().manual_seed(9)) * 6
    logits = torch.stack([flat, peaked] * N)
    params = [SP(top_p=0.8), SP(top_p=0.8)] * N
    toks = run(logits, params, sampler=Sampler(seed=3)).token_ids
    for r, row in enumerate((flat, peaked)):
        probs = torch.softmax(row.double(), -1)
        s, order = probs.sort(descending=True)
        n_keep = int(((s.cumsum(0) - s) < 0.8 + 1e-4).sum())
        allowed = set(order[:n_keep].tolist())
        got = toks[r::2]
        assert set(got) <= allowed, r
        if r == 0:
            rank = {t: i for i, t in enumerate(order.tolist())}
            assert n_keep > 1024 and max(rank[t] for t in got) > 1024


def test_top_p_tiny_is_argmax():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(3))
    out = run(logits, [SP(temperature=1.0, top_p=1e-6)] * 64)
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize(("p", "expected"), [(0.65, {0, 1}), (0.75, {0, 1, 2}), (0.35, {0})])
def test_top_p_keeps_smallest_prefix_reaching_p(p, expected):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(3000, 4)
    toks = set(run(logits, [SP(temperature=1.0, top_p=p)] * 3000).token_ids)
    assert toks == expected


def test_min_p_filters_below_fraction_of_max():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    toks = run(logits, [SP(min_p=0.2)] * 4000).token_ids  # threshold 0.2 * 0.5 = 0.1
    assert set(toks) == {0, 1, 2}
    toks = run(logits, [SP(min_p=0.0)] * 4000).token_ids
    assert set(toks) == {0, 1, 2, 3}


def test_temperature_sampling_matches_softmax():
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    N, T = 20000, 0.6
    out = run(base.expand(N, 5), [SP(temperature=T)] * N, sampler=Sampler(seed=1234))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    expected = torch.softmax(base.double() / T, -1) * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5. Ignoring T (softmax at T=1) gives chi2 > 1000.
    assert chi2 < 25, (chi2, counts.tolist(), expected.tolist())


def _allowed_set(row: torch.Tensor, p: SamplingParams, slack: float = 1e-4) -> set[int]:
    """Reference filter in float64 with a little slack at the top-p / min-p boundaries."""
    probs = torch.softmax(row.double() / p.temperature, -1)
    order = probs.argsort(descending=True).tolist()
    V = len(order)
    if 0 < p.top_k < V:
        order = order[: p.top_k]
    kept = torch.tensor([probs[i] for i in order])
    kept = kept / kept.sum()
    before = torch.cumsum(kept, 0) - kept
    order = [t for t, b in zip(order, before.tolist(), strict=True) if b < p.top_p + slack]
    pmax = max(float(probs[t]) for t in order)
    total = sum(float(probs[t]) for t in order)
    return {t for t in order if float(probs[t]) / total >= p.min_p * pmax / total - slack}


@given(
    seed=st.integers(0, 2**31),
    V=st.integers(2, 40),
    t=st.floats(0.05, 3.0),
    k=st.sampled_from([-1, 0, 2, 3, 10]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
)
@settings(max_examples=60, deadline=None)
def test_sampled_tokens_stay_inside_filters(seed, V, t, k, top_p, min_p):
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(1, V, generator=g) * 2
    p = SP(temperature=t, top_k=k, top_p=top_p, min_p=min_p)
    allowed = _allowed_set(row[0], p)
    out = run(row.expand(64, V), [p] * 64, sampler=Sampler(seed=seed))
    assert set(out.token_ids) <= allowed


# --------------------------------------------------------------------------- seeds


def test_seeded_row_is_independent_of_batch():
    V, steps, seed = 64, 20, 4242
    target = SP(seed=seed, temperature=0.9, top_p=0.95, top_k=40, presence_penalty=0.3)
    step_logits = torch.randn(steps, V, generator=torch.Generator().manual_seed(7)) * 2

    def trajectory(batched: bool) -> list[int]:
        sampler = Sampler(seed=99 if batched else 0)
        gen = make_generator(seed, "cpu")
        noise = torch.Generator().manual_seed(11)
        others = [
            SP(),
            SP(seed=5),
            SP(temperature=0),
            SP(top_p=0.5),
            SP(top_k=3, seed=6),
            SP(min_p=0.1),
            SP(repetition_penalty=1.3),
            SP(temperature=2.0),
        ]
        other_gens = [make_generator(o.seed, "cpu") for o in others]
        out_ids: list[int] = []
        for s in range(steps):
            row = step_logits[s : s + 1]
            if not batched:
                res = run(
                    row, [target], output_ids=[list(out_ids)], generators=[gen], sampler=sampler
                )
                out_ids.append(res.token_ids[0])
                continue
            n_other = 3 + s % 6  # batch size varies 4..9
            pos = (s * 5) % (n_other + 1)  # and so does the target's position
            logits = torch.randn(n_other, V, generator=noise)
            logits = torch.cat([logits[:pos], row, logits[pos:]])
            params = others[:n_other]
            gens = other_gens[:n_other]
            params = params[:pos] + [target] + params[pos:]
            gens = gens[:pos] + [gen] + gens[pos:]
            outs = [[1, 2]] * pos + [list(out_ids)] + [[3]] * (n_other - pos)
            res = run(
                logits,
                params,
                output_ids=outs,
                generators=gens,
                sampler=sampler,
                prompt_ids=[[0, 1, 2]] * (n_other + 1),
            )
            out_ids.append(res.token_ids[pos])
        return out_ids

    alone, batched = trajectory(False), trajectory(True)
    assert alone == batched
    assert len(set(alone)) > 3  # really sampled, not argmax every step

    # A different seed draws differently (so the seed really is what is being followed).
    g_a, g_b = make_generator(seed, "cpu"), make_generator(seed + 1, "cpu")
    plain = SP(temperature=1.0)
    flat = torch.zeros(1, V)
    a = [run(flat, [plain], generators=[g_a]).token_ids[0] for _ in range(steps)]
    b = [run(flat, [plain], generators=[g_b]).token_ids[0] for _ in range(steps)]
    assert a != b


def test_unseeded_rows_follow_engine_seed():
    logits = torch.zeros(16, 50)
    a = run(logits, [SP()] * 16, sampler=Sampler(seed=1)).token_ids
    b = run(logits, [SP()] * 16, sampler=Sampler(seed=1)).token_ids
    c = run(logits, [SP()] * 16, sampler=Sampler(seed=2)).token_ids
    assert a == b and a != c


# --------------------------------------------------------------------------- penalties

BASE = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]


def _penalized(params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    x = torch.tensor([BASE])
    _apply_penalties(x, [params], [prompt], [output])
    return x[0].tolist()


def test_repetition_penalty_divides_positive_multiplies_negative():
    got = _penalized(SP(repetition_penalty=2.0), prompt=[0, 1], output=[1, 3, 3, 5])
    # 0 (prompt, +) 2/2; 1 (both, -) -1*2; 3 (output, +) 3/2; 5 (zero) stays 0; 2, 4 unseen.
    assert got == pytest.approx([1.0, -2.0, 0.5, 1.5, -2.0, 0.0])
    got = _penalized(SP(repetition_penalty=0.5), prompt=[4], output=[])
    assert got == pytest.approx([2.0, -1.0, 0.5, 3.0, -1.0, 0.0])


def test_frequency_and_presence_use_output_counts_only():
    got = _penalized(SP(frequency_penalty=0.5), prompt=[0, 2], output=[1, 3, 3])
    assert got == pytest.approx([2.0, -1.5, 0.5, 2.0, -2.0, 0.0])
    got = _penalized(SP(presence_penalty=0.25), prompt=[0, 2], output=[1, 3, 3])
    assert got == pytest.approx([2.0, -1.25, 0.5, 2.75, -2.0, 0.0])
    got = _penalized(SP(presence_penalty=-1.0, frequency_penalty=1.0), prompt=[], output=[4, 4])
    assert got == pytest.approx([2.0, -1.0, 0.5, 3.0, -2.0 - 2.0 + 1.0, 0.0])


def test_penalties_combined_in_a_batch_and_visible_in_logprobs():
    x = torch.tensor([BASE, BASE, BASE])
    params = [
        SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=6),
        SP(logprobs=6),  # untouched neighbour
        SP(frequency_penalty=1.0, logprobs=6),
    ]
    out = run(x, params, prompt_ids=[[0, 1], [0, 1], [0]], output_ids=[[1, 3, 3], [3], [5, 5]])
    # Row 0: repetition first (0: 1.0, 1: -2.0, 3: 1.5), then -0.5*count - 0.25*present.
    want = [
        [1.0, -2.75, 0.5, 0.25, -2.0, 0.0],
        BASE,
        [2.0, -1.0, 0.5, 3.0, -2.0, -2.0],
    ]
    for i in range(3):
        ref = torch.log_softmax(torch.tensor(want[i]), -1)
        got = dict(out.top_logprobs[i])
        assert [got[t] for t in range(6)] == pytest.approx(ref.tolist(), abs=1e-5)


def test_greedy_follows_penalized_logits():
    x = torch.tensor([[5.0, 4.0, 0.0]])
    assert run(x, [SP(temperature=0)], output_ids=[[0]]).token_ids == [0]
    assert run(x, [SP(temperature=0, presence_penalty=2.0)], output_ids=[[0]]).token_ids == [1]
    assert run(x, [SP(temperature=0, repetition_penalty=1.5)], prompt_ids=[[0]]).token_ids == [1]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_equal_log_softmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(5)) * 3
    params = [
        SP(logprobs=3, temperature=0.5),
        SP(),
        SP(logprobs=0, temperature=0),
        SP(logprobs=20, temperature=0.3),
        SP(logprobs=1, top_k=4),
    ]
    out = run(logits, params)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, tok in enumerate(out.token_ids):
        # Every row gets its chosen logprob once any row asked; temperature does not enter.
        assert out.logprobs[i] == pytest.approx(float(ref[i, tok]), abs=1e-5)
    for i, p in enumerate(params):
        n = p.logprobs or 0
        top = out.top_logprobs[i]
        assert len(top) == n
        vals, ids = ref[i].topk(max(n, 1))
        assert [t for t, _ in top] == ids[:n].tolist()
        assert [v for _, v in top] == pytest.approx(vals[:n].tolist(), abs=1e-5)


def test_no_logprobs_when_nobody_asks():
    out = run(torch.randn(3, 10), [SP()] * 3)
    assert out.logprobs is None and out.top_logprobs is None
    out = run(torch.randn(3, 10), [SP(logprobs=0), SP(), SP()])
    assert out.logprobs is not None and len(out.logprobs) == 3 and out.top_logprobs is None


# --------------------------------------------------------------------------- EOS / min_tokens


def test_eos_masking_ignore_eos_and_min_tokens():
    EOS, STOP = 7, 2
    x = torch.zeros(1, 10)
    x[0, EOS], x[0, STOP], x[0, 4] = 10.0, 9.0, 8.0
    g = SP(temperature=0)
    assert run(x, [g], eos=[EOS]).token_ids == [EOS]
    assert run(x, [g.model_copy(update={"ignore_eos": True})], eos=[EOS]).token_ids == [STOP]
    p = SP(temperature=0, min_tokens=3, stop_token_ids=[STOP], logprobs=0)
    early = run(x, [p], output_ids=[[1, 1]], eos=[EOS])
    assert early.token_ids == [4]  # EOS and the stop token are both held back
    assert run(x, [p], output_ids=[[1, 1, 1]], eos=[EOS]).token_ids == [EOS]
    # Random rows and a batch: bans are per row; out-of-vocab EOS ids are ignored.
    xs = x.expand(3, 10)
    params = [SP(ignore_eos=True, temperature=0.01), SP(temperature=0.01), SP(temperature=0)]
    out = run(xs, params, eos=[EOS, 1000])
    assert out.token_ids == [STOP, EOS, EOS]
    # Logprobs reflect the ban (the masked EOS has -inf, so the rest renormalize).
    assert math.isfinite(early.logprobs[0]) and early.logprobs[0] > -0.2


def test_greedy_fast_path_bans_match_full_path():
    # An all-greedy batch without logprobs takes one argmax; with a logprobs row it takes the
    # full path. Bans (ignore_eos, min_tokens and its stop ids) must pick the same tokens.
    EOS, STOP = 7, 2
    x = torch.zeros(5, 10)
    x[:, EOS], x[:, STOP], x[:, 4] = 10.0, 9.0, 8.0
    params = [SP(temperature=0, ignore_eos=True), SP(temperature=0),
              SP(temperature=0, min_tokens=3, stop_token_ids=[STOP, 99]),
              SP(temperature=0, min_tokens=3, stop_token_ids=[STOP]), SP(top_k=1, ignore_eos=True)]
    outs = [[1], [1], [1, 1], [1, 1, 1], []]
    fast = run(x, params, output_ids=outs, eos=[EOS, 1000])
    full = run(x, [*params[:4], params[4].model_copy(update={"logprobs": 0})], output_ids=outs,
               eos=[EOS, 1000])
    assert fast.token_ids == full.token_ids == [STOP, EOS, 4, EOS, STOP]
    assert fast.logprobs is None
    assert run(x[:2], [SP(temperature=0, ignore_eos=True)] * 2, output_ids=[[1]] * 2,
               eos=[EOS]).token_ids == [STOP, STOP]


# --------------------------------------------------------------------------- misc


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_untouched_half_precision_and_device(device):
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(8)).to(device)
    keep = logits.clone()
    params = [
        SP(repetition_penalty=1.5, presence_penalty=1.0, seed=3),
        SP(temperature=0),
        SP(top_p=0.5, logprobs=2),
        SP(top_k=5, min_p=0.1),
    ]
    gens = [make_generator(p.seed, device) for p in params]
    out = run(
        logits, params, prompt_ids=[[1, 2]] * 4, output_ids=[[3]] * 4, generators=gens, eos=[0]
    )
    assert torch.equal(logits, keep)
    assert all(0 < t < 40 for t in out.token_ids)
    half = run(logits.half(), [SP(temperature=0)] * 4).token_ids
    assert half == logits.half().float().argmax(-1).tolist()
    # A non-contiguous view (e.g. logits sliced out of a padded vocab) is read correctly.
    padded = torch.cat([torch.full((4, 8), 100.0, device=device), logits], dim=1)
    view = padded[:, 8:]
    pen = SP(temperature=0, repetition_penalty=1e3)
    got = run(view, [pen] * 4, prompt_ids=[[int(t)] for t in logits.argmax(-1)]).token_ids
    assert got == logits.topk(2).indices[:, 1].tolist()


def test_batch_size_mismatch_raises():
    with pytest.raises(ValueError, match="batch"):
        Sampler()(torch.zeros(2, 5), [SP()], [[]], [[]], [None])
