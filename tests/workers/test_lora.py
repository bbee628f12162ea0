"""LoRA adapters in the engine against PEFT + transformers (the oracle), on a tiny random
Llama with tiny random adapters of different ranks and targets: greedy tokens per adapter in
mixed batches, more adapters than device slots, host-memory cache and disk reloads, loading
and unloading while streams run, a parked stream whose adapter lost its slot, KV never shared
across adapters, snapshots to another engine, and bad adapters refused with nothing kept."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from engine_runs import run_to_end
from lora_adapters import ATTN, make_adapter, peft_greedy
from tiny_models import make_tiny_hf_model, tiny_model_path

from kvserve import LLM, SamplingParams
from kvserve.errors import AdapterError, NotFoundError
from kvserve.workers.engine.engine import LLMEngine
from kvserve.workers.engine.sequence import Status

N = 10  # tokens generated per request
PROMPTS = [[5, 17, 300, 42, 99, 1000, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
           [400, 401, 402, 403, 404, 405], [777] * 9 + [31, 32, 33]]
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    """Five adapters: ranks 2 to 16, all seven modules or some, rsLoRA, a rank pattern."""
    root = tmp_path_factory.mktemp("loras")
    return {
        "r2": make_adapter(base, str(root / "r2"), 2, seed=1),
        "r8-attn": make_adapter(base, str(root / "r8"), 8, seed=2, targets=ATTN),
        "r16-qv-down": make_adapter(base, str(root / "r16"), 16, seed=3,
                                    targets=["q_proj", "v_proj", "down_proj"]),
        "r4-rs": make_adapter(base, str(root / "r4"), 4, seed=4, use_rslora=True, alpha=3.0),
        "r6-pattern": make_adapter(base, str(root / "r6"), 6, seed=5,
                                   rank_pattern={"o_proj": 3}, alpha_pattern={"down_proj": 20}),
    }


@pytest.fixture(scope="module")
def oracle(base, adapters) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens for every prompt, per adapter (None: the base model)."""
    return peft_greedy(base, adapters, PROMPTS, N)


def engine(base: str, loras: dict[str, str], **kw) -> LLMEngine:
    kw.setdefault("kv_cache_tokens", 2048)
    kw.setdefault("host_cache_gib", 0)
    kw.setdefault("max_model_len", 256)
    return LLM(base, block_size=4, num_threads=1, loras=loras, enable_lora=True, **kw).engine


def submit(eng: LLMEngine, names: list[str | None]) -> dict[str, tuple[str | None, int]]:
    """Every prompt under every name, interleaved (adapters mixed in the same steps)."""
    ids = {}
    for i, p in enumerate(PROMPTS):
        for name in names:
            ids[eng.add_request(p, GREEDY, lora=name)] = (name, i)
    return ids


def check(got: dict[str, list[int]], ids: dict, oracle: dict) -> None:
    for rid, (name, i) in ids.items():
        assert got[rid] == oracle[name][i], f"adapter {name}, prompt {i}"


def assert_clean(eng: LLMEngine) -> None:
    eng.check_invariants()
    assert eng.kv.streams == {} and eng.kv.pool.num_used == 0
    ads = eng.adapters
    assert ads is not None
    for ad in [*ads.by_name.values(), *ads.host.values()]:
        assert ad.users == 0 and ad.running == 0, ad.name


def test_adapters_of_different_ranks_in_one_batch_match_peft(base, adapters, oracle):
    eng = engine(base, adapters, max_loras=len(adapters))
    names = [None, *adapters]
    ids = submit(eng, names)
    mixed = []
    got = run_to_end(eng, lambda e: mixed.append(len({s.lora_slot for s in e.scheduler.running})))
    check(got, ids, oracle)
    assert max(mixed) == len(names)  # the base and every adapter ran in the same steps
    # each adapter really changes the output (a LoRA applied nowhere would pass the above)
    for name in adapters:
        assert oracle[name] != oracle[None], name
    assert eng.stats()["lora_slot_loads"] == len(adapters)
    assert_clean(eng)


def test_more_adapters_than_slots_swap_by_copy_from_host_memory(base, adapters, oracle):
    eng = engine(base, adapters, max_loras=2, max_cpu_loras=len(adapters))
    disk = eng.stats()["lora_disk_loads"]
    ids = submit(eng, [None, *adapters])
    peak = []
    got = run_to_end(eng, lambda e: peak.append(
        len({s.lora_slot for s in e.scheduler.running if s.lora is not None})))
    check(got, ids, oracle)
    s = eng.stats()
    assert max(peak) <= 2
    assert s["lora_slot_loads"] > len(adapters) - 1 and s["lora_slot_evictions"] > 0
    assert s["lora_disk_loads"] == disk  # every swap was a copy from host memory
    assert_clean(eng)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_kv_pressure_parks_lora_streams_and_they_resume_with_their_adapter(
        base, adapters, oracle, async_scheduling):
    # a pool too small for every stream at once: streams are parked to the host tier and
    # come back (by copy, under their adapter's hash chain), while two slots serve five
    # adapters
    eng = engine(base, adapters, max_loras=2, kv_cache_tokens=96, max_model_len=64,
                 host_cache_gib=0.01, host_restore_policy="copy", admission_lookahead_tokens=0,
                 async_scheduling=async_scheduling)
    ids = submit(eng, [None, *adapters])
    check(run_to_end(eng), ids, oracle)
    s = eng.stats()
    assert s["evictions"] > 0 and s["tokens_restored_copy"] > 0
    assert s["lora_slot_evictions"] > 0
    assert_clean(eng)


def test_host_cache_limit_reads_dropped_adapters_from_disk_again(base, adapters, oracle):
    eng = engine(base, adapters, max_loras=1, max_cpu_loras=2)
    s = eng.stats()
    assert s["lora_host_adapters"] == 2 and s["lora_disk_loads"] == len(adapters)
    names = list(adapters)
    for name in names:  # one adapter after another: each needs its host copy back
        ids = {eng.add_request(p, GREEDY, lora=name): (name, i) for i, p in enumerate(PROMPTS)}
        check(run_to_end(eng), ids, oracle)
        assert eng.stats()["lora_host_adapters"] <= 2
    assert eng.stats()["lora_disk_loads"] > len(adapters)
    assert_clean(eng)


def test_streams_wait_for_a_slot_while_others_go_ahead(base, adapters, oracle):
    eng = engine(base, adapters, max_loras=1)
    a, b = "r2", "r8-attn"
    first = eng.add_request(PROMPTS[0], GREEDY, lora=a)
    eng.step()
    blocked = eng.add_request(PROMPTS[1], GREEDY, lora=b)
    plain = eng.add_request(PROMPTS[2], GREEDY)
    eng.step()
    running = {s.request_id for s in eng.scheduler.running}
    assert first in running and plain in running and blocked not in running
    got = run_to_end(eng)
    assert got[first] == oracle[a][0] and got[blocked] == oracle[b][1]
    assert got[plain] == oracle[None][2]
    assert_clean(eng)


def test_unknown_adapter_is_not_found_and_nothing_is_queued(base, adapters):
    eng = engine(base, {"r2": adapters["r2"]})
    with pytest.raises(NotFoundError, match="nope"):
        eng.add_request(PROMPTS[0], GREEDY, lora="nope")
    assert not eng.has_unfinished()
    plain = LLM(base, block_size=4, num_threads=1, kv_cache_tokens=1024).engine
    with pytest.raises(NotFoundError, match="serves no LoRA"):
        plain.add_request(PROMPTS[0], GREEDY, lora="r2")


def test_load_and_unload_while_streams_run(base, adapters, oracle):
    eng = engine(base, {"r2": adapters["r2"]}, max_loras=2)
    a = [eng.add_request(p, GREEDY, lora="r2") for p in PROMPTS]
    for _ in range(3):
        eng.step()
    # loaded mid-run: new requests use it in the same steps as the running ones
    assert eng.add_lora("late", adapters["r8-attn"])["rank"] == 8
    b = eng.add_request(PROMPTS[0], GREEDY, lora="late")
    eng.step()
    # unloaded mid-run: its running streams finish with it, new requests cannot name it
    eng.remove_lora("r2")
    with pytest.raises(NotFoundError):
        eng.add_request(PROMPTS[0], GREEDY, lora="r2")
    assert [x["name"] for x in eng.list_loras()] == ["late"]
    retired = next(s.lora for s in eng.scheduler.running if s.request_id == a[0])
    assert retired.weights is not None  # still in use
    got = run_to_end(eng)
    assert [got[r] for r in a] == oracle["r2"]
    assert got[b] == oracle["r8-attn"][0]
    # freed once its last stream left: no host copy, no slot
    assert retired.weights is None and retired.slot == -1
    assert eng.stats()["lora_host_adapters"] == 1
    # and the name can be loaded again (here: other weights under it)
    eng.add_lora("r2", adapters["r16-qv-down"])
    rid = eng.add_request(PROMPTS[1], GREEDY, lora="r2")
    assert run_to_end(eng)[rid] == oracle["r16-qv-down"][1]
    assert_clean(eng)


def test_a_parked_stream_whose_adapter_lost_its_slot_resumes_by_copy(base, adapters, oracle):
    eng = engine(base, adapters, max_loras=1, host_cache_gib=0.01, host_restore_policy="copy")
    a = eng.add_request(PROMPTS[0], GREEDY, lora="r2")
    for _ in range(4):
        eng.step()
    seq = eng.seqs[a]
    assert seq.lora_slot >= 0 and len(seq.output_ids) >= 2
    sched = eng.scheduler
    sched.running.remove(seq)
    sched.park(seq)
    assert seq.lora_slot == -1 and seq.lora.running == 0 and seq.lora.weights is not None
    # another adapter takes the only slot while it is parked (held out of the queue for
    # that step: parked streams come back first)
    sched.parked.remove(seq)
    b = eng.add_request(PROMPTS[1], GREEDY, lora="r8-attn")
    eng.step()
    sched.parked.append(seq)
    assert seq.status == Status.WAITING and seq.lora.slot == -1  # evicted from the slot
    eng.step()  # b holds the slot: the parked stream waits
    assert seq.status == Status.WAITING
    disk = eng.stats()["lora_disk_loads"]
    got = run_to_end(eng)
    assert got[a] == oracle["r2"][0] and got[b] == oracle["r8-attn"][1]
    s = eng.stats()
    assert s["lora_disk_loads"] == disk and s["lora_slot_evictions"] >= 2
    assert s["tokens_restored_copy"] > 0  # its KV came back from the host tier, by its hashes
    assert_clean(eng)


def test_kv_is_never_shared_between_adapters_or_with_the_base(base, adapters, oracle):
    eng = engine(base, adapters, max_loras=2)
    p = PROMPTS[0]  # 19 tokens: four full blocks of 4
    order = [None, "r2", "r8-attn", "r2", None]
    cached = []
    for name in order:
        rid = eng.add_request(p, GREEDY, lora=name)
        out = run_to_end(eng)[rid]
        assert out == oracle[name][0], name
    for name in order:  # a second pass: each finds only its own blocks
        rid = eng.add_request(p, SamplingParams(temperature=0, max_tokens=2), lora=name)
        eng.step()
        cached.append(eng.seqs[rid].num_cached_prompt)
        run_to_end(eng)
    assert all(c == 16 for c in cached), cached
    # first pass: the first request of each name computed everything, repeats hit
    eng2 = engine(base, adapters, max_loras=2)
    firsts = []
    for name in [None, "r2", "r8-attn", "r2"]:
        rid = eng2.add_request(p, SamplingParams(temperature=0, max_tokens=2), lora=name)
        eng2.step()
        firsts.append(eng2.seqs[rid].num_cached_prompt)
        run_to_end(eng2)
    assert firsts == [0, 0, 0, 16]
    assert_clean(eng)


def test_snapshot_moves_a_lora_stream_to_an_engine_that_loads_its_adapter(base, adapters, oracle):
    src = engine(base, adapters, host_cache_gib=0.01, host_restore_policy="copy")
    dst = engine(base, {}, host_cache_gib=0.01, host_restore_policy="copy")
    rid = src.add_request(PROMPTS[2], GREEDY, lora="r16-qv-down")
    for _ in range(4):
        src.step()
    data = src.export_stream(rid)
    assert not src.has_unfinished()
    dst.import_stream(data)
    assert [x["name"] for x in dst.list_loras()] == ["r16-qv-down"]
    got = run_to_end(dst)
    assert got[rid] == oracle["r16-qv-down"][2]
    assert dst.stats()["tokens_restored_copy"] > 0
    assert_clean(src)
    assert_clean(dst)


def test_snapshot_refuses_an_adapter_that_differs_under_the_same_name(base, adapters):
    src = engine(base, {"x": adapters["r2"]})
    dst = engine(base, {"x": adapters["r4-rs"]})
    rid = src.add_request(PROMPTS[0], GREEDY, lora="x")
    src.step()
    data = src.export_stream(rid)
    with pytest.raises(Exception, match="differs"):
        dst.import_stream(data)
    assert not dst.has_unfinished()
    assert_clean(dst)


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapters_are_refused_with_nothing_kept(base, adapters, tmp_path):
    eng = engine(base, {"good": adapters["r2"]}, max_lora_rank=8)
    before = eng.list_loras()
    cases: list[tuple[str, str]] = []
    cases.append((adapters["r16-qv-down"], "rank 16 .* above max_lora_rank 8"))
    # an unsupported module: PEFT targets lm_head too
    cases.append((make_adapter(base, str(tmp_path / "head"), 2, seed=9,
                               targets=["q_proj", "lm_head"]), "lm_head"))
    # an adapter for another base model (other hidden size)
    other = make_tiny_hf_model(tmp_path / "other", "llama", seed=3, hidden_size=32,
                               with_tokenizer=False)
    cases.append((make_adapter(other, str(tmp_path / "other_lora"), 2, seed=9),
                  "another base model"))
    corrupt = _copy(adapters["r2"], str(tmp_path / "corrupt"))
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "r+b") as f:
        f.truncate(100)
    cases.append((corrupt, "corrupt"))
    no_weights = _copy(adapters["r2"], str(tmp_path / "noweights"))
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    cases.append((no_weights, "no adapter_model.safetensors"))
    no_config = _copy(adapters["r2"], str(tmp_path / "noconfig"))
    os.remove(os.path.join(no_config, "adapter_config.json"))
    cases.append((no_config, "no adapter_config.json"))
    cases.append((str(tmp_path / "missing"), "does not exist"))
    dora = _copy(adapters["r2"], str(tmp_path / "dora"))
    cfg_path = os.path.join(dora, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["use_dora"] = True
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    cases.append((dora, "DoRA"))
    for path, why in cases:
        with pytest.raises(AdapterError, match=why):
            eng.add_lora("bad", path)
        assert eng.list_loras() == before
    # the same name with other weights is refused; the same adapter again is a no-op
    with pytest.raises(AdapterError, match="already loaded"):
        eng.add_lora("good", adapters["r4-rs"])
    eng.add_lora("good", adapters["r2"])
    assert eng.list_loras() == before
    # still serving
    rid = eng.add_request(PROMPTS[0], GREEDY, lora="good")
    assert len(run_to_end(eng)[rid]) == N
    assert_clean(eng)


def test_lora_settings_are_checked():
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(loras={"a": "/x"}, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="names must"):
        EngineConfig(loras={"a:b": "/x"})
