"""Speculative decoding gives plain decoding's output (real engines on tiny random models with
SmolLM2's tokenizer, and the default model): greedy across the model families, seeded
sampling with penalties, logprobs and min_tokens, stop strings inside accepted proposals,
structured outputs, logit_bias, parked (with and without the host tier), moved (snapshots)
and aborted streams. Unseeded sampling keeps the target's distribution (chi-square). Rejected
proposals never reach the prefix cache or the host tier: every block hash either holds is a
prefix of some request's accepted tokens. Every KV block comes back after each run.

Proposals are verified whatever the cost model says (`SpecPolicy.always`) so the verify
path runs every step; the policy's own decisions are tested on their own."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import jsonschema
import pytest
from arch_models import make_arch_model
from moe_models import make_moe_model
from tiny_models import make_tiny_hf_model, tiny_model_path

from kvserve import LLM, SamplingParams
from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.structured import json_schema_output
from kvserve.workers.engine.engine import LLMEngine
from kvserve.workers.engine.spec_propose import ngram_lookup

BS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


def engine(path: str, spec: dict | None = None, always: bool = True, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("host_cache_gib", 0)
    kw.setdefault("max_num_seqs", 16)
    eng = LLM(path, block_size=BS, dtype="float32", num_threads=2, speculative_config=spec,
              **kw).engine
    if eng.spec is not None:
        eng.spec.policy.always = always
    return eng


def looping(n: int, seed: int, period: int = 5, reps: int = 4) -> list[list[int]]:
    """Prompts that repeat a short pattern (so lookups find proposals), with a varied tail."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pat = [rng.randrange(100, 40000) for _ in range(period)]
        out.append(pat * reps + [rng.randrange(100, 40000) for _ in range(i % 4)])
    return out


def copying(path: str, n: int, seed: int) -> list[list[int]]:
    """Prompts that end in the model's own greedy output, cut where the next 8 tokens are what
    a lookup proposes (a random model's output repeats itself for stretches): greedy
    continuations accept proposals from the first step on."""
    ps = looping(8 * n, seed)
    out = drive(engine(path), [(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                               for p in ps])
    found = []
    for i, p in enumerate(ps):
        ids = p + out[f"r{i}"]["ids"]
        for k in range(len(p) + 1, len(ids) - 8):
            if all(ngram_lookup(ids[:j], 1, 3, 1) == [ids[j]] for j in range(k, k + 8)):
                found.append(ids[:k])
                break
    assert len(found) >= n, "too few outputs of the tiny model repeat themselves"
    return found[:n]


def accepted_hashes(eng: LLMEngine, seqs: list[list[int]]) -> None:
    """Every full block the device prefix cache or the host tier holds is a prefix of one of
    `seqs` (prompt + output): no proposal that was not accepted was ever hashed."""
    allowed = set()
    for ids in seqs:
        allowed.update(hash_full_blocks(ids, BS))
    held = set(eng.kv.pool.cached)
    if eng.kv.host is not None:
        held |= set(eng.kv.host.table.cached)
    assert held, "nothing was cached"
    assert held <= allowed, f"{len(held - allowed)} blocks hold tokens no request kept"


def drive(eng: LLMEngine, reqs: list[tuple[list[int], SamplingParams]], on_step=None) -> dict[str, dict]:
    """Run to completion; per request its final output, checked against what its streamed
    outputs added up to. Invariants after every step; every block back at the end."""
    ids = [eng.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(reqs)]
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    text: dict[str, str] = {i: "" for i in ids}
    final: dict[str, dict] = {}
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id not in final, "an output after the request finished"
            streamed[o.request_id] += o.delta_token_ids
            text[o.request_id] += o.delta_text
            if o.finished:
                final[o.request_id] = {"ids": list(o.token_ids), "text": o.text,
                                       "reason": o.finish_reason, "stop": o.stop_reason,
                                       "lp": o.logprobs, "top": o.top_logprobs}
        eng.check_invariants()
        n += 1
        if on_step is not None:
            on_step(eng, n, streamed)
    for rid, f in final.items():
        if f["reason"] != "abort":
            assert streamed[rid] == f["ids"] and text[rid] == f["text"], rid
    assert eng.kv.streams == {} and eng.kv.held == {} and eng.kv.pool.num_used == 0
    assert eng.kv.host is None or eng.kv.host.num_used == 0
    if eng.spec is not None and hasattr(eng.spec.proposer, "runner"):
        assert eng.spec.proposer.runner.kv.pool.num_used == 0
    return final


def same(a: dict[str, dict], b: dict[str, dict]) -> bool:
    """The same outputs; logprobs within float32 rounding (a row computed in a step of more
    rows may differ in the last bits, as between plain batches of different sizes)."""
    assert a.keys() == b.keys()
    for rid in a:
        x, y = a[rid], b[rid]
        assert {k: v for k, v in x.items() if k not in ("lp", "top")} == \
            {k: v for k, v in y.items() if k not in ("lp", "top")}, rid
        assert (x["lp"] is None) == (y["lp"] is None) and (x["top"] is None) == (y["top"] is None)
        if x["lp"] is not None:
            assert x["lp"] == pytest.approx(y["lp"], rel=1e-4, abs=1e-4), rid
        if x["top"] is not None:
            assert [[t for t, _ in r] for r in x["top"]] == [[t for t, _ in r] for r in y["top"]]
            assert [v for r in x["top"] for _, v in r] == pytest.approx(
                [v for r in y["top"] for _, v in r], rel=1e-4, abs=1e-4), rid
    return True


def spec_stats(eng: LLMEngine) -> dict:
    return {k: v for k, v in eng.stats().items() if k.startswith("spec_")}


# ---- greedy: identical tokens across the model families --------------------------------

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe"]


def family_path(root, fam: str) -> str:
    d = root / fam
    if fam in ("llama", "mistral", "qwen2"):
        extra = {"sliding_window": 8} if fam == "mistral" else {}
        return make_tiny_hf_model(d, fam, seed=3, **extra)
    if fam == "qwen3_moe":
        return make_moe_model(d, fam, seed=3)
    return make_arch_model(d, fam, seed=3)


# the default tier runs one family; the heavy tier all of them
@pytest.mark.parametrize("family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_greedy_tokens_identical_across_families(tmp_path, family):
    path = family_path(tmp_path, family)
    reqs = [(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
            for p in looping(5, seed=1)]
    plain = drive(engine(path), reqs)
    eng = engine(path, NGRAM)
    spec = drive(eng, reqs)
    assert spec == plain
    st = spec_stats(eng)
    assert st["spec_drafts"] > 0 and st["spec_draft_tokens"] >= st["spec_drafts"]
    assert 0 <= st["spec_accepted_tokens"] <= st["spec_draft_tokens"]
    accepted_hashes(eng, [p + plain[f"r{i}"]["ids"] for i, (p, _) in enumerate(reqs)])


@pytest.mark.slow
def test_greedy_identical_on_the_default_model(smol_path):
    """The default model (Q4_1 blocks through the small-row kernel) on copy-heavy prompts: the
    same tokens, most proposals accepted."""
    text = ("Copy the list exactly.\n- red apple\n- green pear\n- blue plum\n- black grape\n"
            "- white melon\nCopy:\n- red apple\n")
    reqs = [(text, SamplingParams(temperature=0, max_tokens=40))]
    kw = {"kv_cache_tokens": 2048, "max_num_seqs": 4, "block_size": 16}
    plain = LLM(smol_path, num_threads=2, host_cache_gib=0, **kw)
    spec = LLM(smol_path, num_threads=2, host_cache_gib=0, speculative_config=NGRAM, **kw)
    spec.engine.spec.policy.always = True
    a = plain.generate([r[0] for r in reqs], reqs[0][1])
    b = spec.generate([r[0] for r in reqs], reqs[0][1])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    st = spec_stats(spec.engine)
    assert st["spec_accepted_tokens"] > st["spec_draft_tokens"] / 2, st
    assert st["spec_mean_accepted_length"] > 2, st


# ---- sampling ----------------------------------------------------------------------------

@pytest.mark.slow
def test_seeded_sampling_is_plain_sampling(path):
    """A seeded request draws each position's noise as plain decoding does (the generator
    rewound after a rejection): the same tokens and logprobs, with penalties, top-k/p/min-p,
    min_tokens, logprobs and logit_bias."""
    ps = looping(8, seed=2)
    # a random tiny model's distributions are flat: low temperatures and small top-k make
    # proposals worth accepting now and then
    params = [SamplingParams(temperature=0.05 + 0.1 * (i % 3), top_p=0.95 if i % 2 else 1.0,
                             top_k=3 if i % 3 == 0 else -1, min_p=0.05 if i == 5 else 0.0,
                             seed=100 + i, max_tokens=24,
                             repetition_penalty=1.2 if i % 4 == 1 else 1.0,
                             frequency_penalty=0.3 if i % 4 == 2 else 0.0,
                             min_tokens=6 if i % 4 == 3 else 0, logprobs=2 if i % 2 == 0 else None,
                             logit_bias={ps[i][0]: 3.0} if i == 6 else None)
              for i in range(8)]
    reqs = list(zip(ps, params, strict=True))
    plain = drive(engine(path), reqs)
    eng = engine(path, NGRAM)
    assert same(drive(eng, reqs), plain)
    st = spec_stats(eng)
    assert st["spec_accepted_tokens"] > 0 and st["spec_accepted_tokens"] < st["spec_draft_tokens"]


@pytest.mark.slow
def test_sampled_tokens_keep_the_target_distribution(path):
    """Unseeded sampling over a vocabulary cut to 4 tokens (an equal logit_bias lifts them
    above every other, top_k keeps them; their relative odds are the model's), with a prompt
    of those tokens so every position has a lookup proposal: the second output token after a
    given first one follows the target's distribution (chi-square, deterministic: the
    engine's generator is seeded), and its proposal d is accepted about p(d) of the time,
    the standard rejection sampler's rate for a one-token proposal."""
    rng = random.Random(5)
    vocab = [rng.randrange(100, 40000) for _ in range(4)]
    prompt = [vocab[i] for i in (0, 1, 2, 3, 1, 3, 0, 2, 2, 0, 3, 1)] * 2
    bias = {t: 60.0 for t in vocab}
    sp = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, logit_bias=bias)
    n = 600
    eng = engine(path, NGRAM, max_num_seqs=64)
    out = drive(eng, [(prompt, sp)] * n)
    assert all(set(f["ids"]) <= set(vocab) for f in out.values())
    st = spec_stats(eng)
    assert st["spec_drafts"] >= n  # every second and third token was verified
    pairs = Counter((f["ids"][0], f["ids"][1]) for f in out.values())
    first = Counter(t for t, _ in pairs.elements()).most_common(1)[0][0]
    seconds = Counter({b: c for (a, b), c in pairs.items() if a == first})
    m = sum(seconds.values())
    assert m >= 100
    # the target's distribution after `first`: the 4 tokens' logprobs, renormalised
    probe = drive(engine(path), [(prompt + [first], SamplingParams(
        temperature=0, max_tokens=1, logprobs=4, ignore_eos=True, logit_bias=bias))])["r0"]
    top = dict(probe["top"][0])
    assert set(top) == set(vocab)
    z = sum(math.exp(v) for v in top.values())
    p = {t: math.exp(v) / z for t, v in top.items()}
    chi2 = sum((seconds.get(t, 0) - m * q) ** 2 / (m * q) for t, q in p.items())
    assert chi2 < 16.3, (chi2, seconds, p)  # 3 degrees of freedom: p = 0.001
    # the proposal for the second token after `first`, and how often it was the token
    d = eng.spec.proposer.propose([type("S", (), {"all_ids": prompt + [first]})()], [1])[0][0]
    got, want = seconds.get(d, 0) / m, p[d]
    assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / m) + 0.01, (got, want)


# ---- stops, structure, bias --------------------------------------------------------------

@pytest.mark.slow
def test_stop_strings_and_ids_inside_accepted_proposals(path):
    """A stop string or stop id met inside a step's accepted proposals ends the output there,
    as plain decoding does; the tokens after it in that step are dropped."""
    ps = looping(6, seed=1)
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    steps: dict[str, list[list[int]]] = {}

    def record(eng, n, streamed):  # each request's tokens of each step
        for rid, toks in streamed.items():
            done = sum(len(x) for x in steps.setdefault(rid, []))
            if len(toks) > done:
                steps[rid].append(toks[done:])
    ref = drive(engine(path, NGRAM), [(p, base) for p in ps], on_step=record)
    tok = engine(path).tokenizer
    params = []
    inside = 0
    for i in range(6):
        ids = ref[f"r{i}"]["ids"]
        # a token emitted after the first of a step's tokens (an accepted proposal or the one
        # after them) that the output has not had before
        cands = [(k, t) for k, run in enumerate(steps[f"r{i}"]) for t in run[1:]
                 if t not in ids[: sum(len(x) for x in steps[f"r{i}"][:k])] + run[: run.index(t)]]
        if not cands:
            params.append(base)
            continue
        inside += 1
        t = cands[0][1]
        if i % 2 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                         stop=[tok.decode([t]).strip() or tok.decode([t])]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                         stop_token_ids=[t]))
    assert inside >= 3
    reqs = list(zip(ps, params, strict=True))
    plain = drive(engine(path), reqs)
    assert same(drive(engine(path, NGRAM), reqs), plain)
    assert sum(f["reason"] == "stop" for f in plain.values()) >= inside


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "tags", "n"], "additionalProperties": False}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_structured_outputs_stay_valid(path, sampling):
    """The grammar masks every proposed position, proposals it refuses are cut: the output is
    valid JSON of the schema, and the plain run's."""
    spec_out = json_schema_output(SCHEMA, strict=True)
    kw = {"temperature": 0} if sampling == "greedy" else {"temperature": 0.3, "seed": 11}
    ps = looping(4, seed=4)
    reqs = [(p, SamplingParams(max_tokens=80, structured=spec_out, **kw)) for p in ps]
    plain = drive(engine(path), reqs)
    eng = engine(path, NGRAM)
    got = drive(eng, reqs)
    assert got == plain
    for f in got.values():
        jsonschema.validate(json.loads(f["text"]), SCHEMA)
    st = spec_stats(eng)
    assert st["spec_drafts"] > 0
    if sampling == "greedy":
        assert st["spec_accepted_tokens"] > 0 and st["spec_proposals_cut"] > 0, st


# ---- parked, moved, aborted --------------------------------------------------------------

@pytest.mark.parametrize("host", [pytest.param(0, marks=pytest.mark.slow), 0.002])
def test_parked_streams_keep_only_accepted_tokens(path, host):
    """A pool too small for the batch parks streams between steps (with the host tier: their
    blocks written back): outputs are plain decoding's, and neither tier holds a block of a
    rejected proposal."""
    ps = looping(8, seed=6, reps=3)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [(p, sp) for p in ps]
    ref = drive(engine(path), reqs)
    kw = {"kv_cache_tokens": 40 * BS, "host_cache_gib": host, "admission_lookahead_tokens": 0}
    eng = engine(path, NGRAM, **kw)
    assert drive(eng, reqs) == ref
    st = eng.stats()
    assert st["evictions"] > 0 and st["spec_drafts"] > 0
    accepted_hashes(eng, [p + ref[f"r{i}"]["ids"] for i, (p, _) in enumerate(reqs)])


@pytest.mark.slow
def test_snapshot_mid_speculation_resumes_elsewhere(path):
    """A stream exported between two speculating steps carries only accepted tokens (and its
    generator after them): it resumes on an engine with speculation, or without, and ends as
    the unmoved run."""
    p = copying(path, 1, seed=7)[0]
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=0.05, top_k=3, seed=3, max_tokens=30,
                                  ignore_eos=True)):
        want = drive(engine(path), [(p, params)])["r0"]["ids"]
        for spec_to in (NGRAM, None):
            src, dst = engine(path, NGRAM), engine(path, spec_to)
            src.add_request(p, params, request_id="m")
            got: list[int] = []
            # step until a verification happened (and the stream runs on)
            while src.stats()["spec_drafts"] == 0 and len(got) < 20:
                for o in src.step():
                    got += o.delta_token_ids
            assert src.stats()["spec_drafts"] > 0 and src.has_unfinished()
            data = src.export_stream("m")
            for o in src.step():
                got += o.delta_token_ids
            assert src.kv.pool.num_used == 0
            dst.import_stream(data)
            while dst.has_unfinished():
                for o in dst.step():
                    got += o.delta_token_ids
                dst.check_invariants()
            assert got == want
            assert dst.kv.pool.num_used == 0


def test_abort_mid_speculation_frees_everything(path):
    ps = looping(4, seed=8)
    eng = engine(path, NGRAM)
    for i, p in enumerate(ps):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                        request_id=f"a{i}")
    for _ in range(100):  # until a verification (a random model's output soon repeats)
        eng.step()
        if eng.stats()["spec_drafts"]:
            break
    assert eng.stats()["spec_drafts"] > 0 and eng.has_unfinished()
    for i in range(4):
        assert eng.abort(f"a{i}")
    eng.step()
    eng.check_invariants()
    assert not eng.has_unfinished() and eng.kv.pool.num_used == 0


# ---- the draft model ---------------------------------------------------------------------

@pytest.mark.slow
def test_draft_model_proposals(path, tmp_path_factory):
    """A draft model (here a smaller random Llama with the same tokenizer, and the target
    itself) proposes; greedy and seeded sampling give plain decoding's tokens. The target as
    its own draft has every greedy proposal accepted. Parked streams' draft KV is dropped
    and caught up."""
    small = make_tiny_hf_model(tmp_path_factory.mktemp("draft"), "llama", seed=9,
                               hidden_size=32, num_attention_heads=2, intermediate_size=64)
    ps = looping(5, seed=9)
    reqs = [(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for p in ps]
    reqs += [(p, SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True))
             for i, p in enumerate(ps[:3])]
    plain = drive(engine(path), reqs)
    for draft in (small, path):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
        eng = engine(path, spec, kv_cache_tokens=48 * BS, admission_lookahead_tokens=0)
        assert drive(eng, reqs) == plain
        st = eng.stats()
        assert st["spec_drafts"] > 0 and st["evictions"] > 0
        if draft == path:
            greedy_drafts = st["spec_draft_tokens"]
            assert st["spec_accepted_tokens"] >= greedy_drafts * 0.5
        assert eng.spec.proposer.runner.kv.pool.num_used == 0


def test_draft_model_must_share_the_tokenizer(path, tmp_path_factory):
    other = make_tiny_hf_model(tmp_path_factory.mktemp("other"), "llama", seed=1,
                               vocab_size=32000)
    with pytest.raises(Exception, match="vocabulary"):
        engine(path, {"method": "draft_model", "model": other, "num_speculative_tokens": 2})


# ---- the policy --------------------------------------------------------------------------

@pytest.mark.slow
def test_disable_by_batch_size(path):
    ps = looping(6, seed=10)
    spec = {**NGRAM, "disable_by_batch_size": 4}
    eng = engine(path, spec)
    out = drive(eng, [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                      for p in ps])
    st = spec_stats(eng)
    assert st["spec_steps_off_batch"] > 0
    # speculation only in steps with fewer than 4 running streams: none while all 6 ran
    assert drive(engine(path), [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                                for p in ps]) == out


def test_policy_follows_acceptance_and_cost():
    """The policy's choice from measured figures: high acceptance on a step whose cost grows
    little with rows speculates long; low acceptance, or rows that cost as much as the step,
    does not."""
    from kvserve.workers.engine.spec_policy import Candidate, SpecPolicy, SpecState, StepCost

    cheap = StepCost([1, 16, 17, 64], [0.020, 0.035, 0.080, 0.160])  # small-row path to 16
    pol = SpecPolicy(4, None, cheap, None)
    good = [Candidate(0.9, 100, False, 4)]
    assert pol.lengths(good, 1, 0, 0) == [4]
    assert pol.lengths([Candidate(0.05, 100, False, 4)], 1, 0, 0) == [0]
    # 16 streams: one more row leaves the small-row path, which costs more than it gains
    many = [Candidate(0.6, 100, False, 4) for _ in range(16)]
    assert pol.lengths(many, 16, 0, 0) == [0] * 16
    assert pol.off_cost == 2
    # disable_by_batch_size: off for a step with that many running streams, whatever it pays
    capped = SpecPolicy(4, 8, cheap, None)
    assert capped.lengths(good, 7, 0, 0) == [4]
    assert capped.lengths(good, 8, 0, 0) == [0] and capped.off_batch == 1
    # the acceptance record: one half to start, then mostly what verifications showed
    s = SpecState()
    assert s.alpha == 0.5
    for _ in range(20):
        s.observe(4, 4)
    assert s.alpha > 0.9
    for _ in range(20):
        s.observe(4, 0)
    for _ in range(20):
        s.observe(4, 0)
    assert s.alpha < 0.1  # forty rejections in a row outweigh twenty full acceptances
    assert pol.lengths([Candidate(s.alpha, 100, False, 4)], 1, 0, 0) == [0]
    # a shadow proposal is scored once the tokens after it decide it
    s = SpecState()
    s.shadow_at, s.shadow = 3, [7, 8, 9]
    s.resolve_shadow([1, 2, 3, 7])  # undecided
    assert s.shadow_at == 3
    s.resolve_shadow([1, 2, 3, 7, 8, 5])  # two accepted, then a mismatch
    assert s.shadow_at == -1 and s.hits == pytest.approx(1.0 * 0.9 + 2)  # prior 1 of 2, decayed


# ---- tensor parallelism ------------------------------------------------------------------

@pytest.mark.slow
def test_ngram_on_a_tensor_parallel_engine(path):
    """The verify step's rows and decode-row attention reach the other rank (its step
    message): greedy tokens equal the single-device engine's, with proposals accepted."""
    reqs = [(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            for p in looping(3, seed=12)]
    plain = drive(engine(path), reqs)
    llm = LLM(path, block_size=BS, dtype="float32", num_threads=2, kv_cache_tokens=4096,
              host_cache_gib=0, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        llm.engine.spec.policy.always = True
        assert drive(llm.engine, reqs) == plain
        st = spec_stats(llm.engine)
        assert st["spec_accepted_tokens"] > 0, st
    finally:
        llm.close()


def test_step_cost_scalar_paths_match_numpy() -> None:
    """The per-step cost model runs in Python floats (numpy's per-call overhead was several
    percent of a CPU step): its interpolation and least-squares update equal numpy's."""
    import numpy as np

    from kvserve.workers.engine.spec_policy import FORGET, KEY_SCALE, SAMPLE_SCALE, StepCost

    cost = StepCost([16, 1, 4, 64], [0.03, 0.01, 0.012, 0.09], 0.0005)
    for t in (0, 1, 2, 3.5, 4, 16, 40, 64, 65, 200):
        assert cost.lin(t) == pytest.approx(float(cost.lin(np.array([t]))[0]), rel=1e-12)
    w, P = cost.w.copy(), cost.P.copy()
    rng = np.random.default_rng(0)
    for _ in range(300):
        t, keys, rr = int(rng.integers(1, 100)), float(rng.integers(0, 5000)), int(rng.integers(0, 3))
        sec = 0.01 + 0.001 * t + 2e-6 * keys + float(rng.normal(0, 1e-4))
        cost.observe(t, keys, rr, sec)
        x = np.array([float(cost.lin(np.array([t]))[0]), keys * KEY_SCALE, rr * SAMPLE_SCALE])
        px = P @ x
        gain = px / (FORGET + x @ px)
        w = w + gain * (sec - x @ w)
        w[0] = max(w[0], 0.05)
        w[1:] = np.maximum(w[1:], 0.0)
        P = (P - np.outer(gain, px)) / FORGET
        if np.trace(P) > 1e4:
            P *= 1e4 / np.trace(P)
        np.testing.assert_allclose(cost.w, w, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(cost.P, P, rtol=1e-9, atol=1e-12)
    assert cost.observed == 300
    assert float(cost.predict(8, 1000, 0)) == pytest.approx(0.01 + 0.008 + 0.002, rel=0.2)
