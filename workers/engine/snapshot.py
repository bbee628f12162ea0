"""Parked-stream snapshots: a self-contained msgpack record that another engine resumes.

A snapshot carries the request (prompt and generated tokens, sampling parameters,
the request's RNG state, streamed text so far) and the KV the host tier saved for
it: its full blocks then its partial tail, as raw bytes in the host tier's block-major
layout ([blocks, L, 2, bs, H, D]).
The importing engine must run the same model geometry; with a different block size
or no host tier it drops the KV and recomputes it (the output is the same).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from kvserve.errors import InvalidRequestError
from kvserve.kvcache.hashing import hash_full_blocks
from kvserve.kvcache.host_cache import ParkedKV
from kvserve.sampling import SamplingParams
from kvserve.workers.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from kvserve.workers.engine.adapters import Adapter
    from kvserve.workers.engine.engine import LLMEngine

VERSION = 2  # 2: block-major KV
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def model_geometry(engine: LLMEngine) -> dict[str, int | str]:
    """What a snapshot's KV and token ids must match: the architecture (its KV means
    something else in another family even at the same shape) and the KV geometry."""
    c = engine.model_config
    return {"architecture": c.architecture, "vocab_size": c.vocab_size,
            "num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}


def stream_record(engine: LLMEngine, seq: Sequence) -> dict[str, Any]:
    """A stream's request state, everything but its KV: tokens, sampling parameters and RNG
    state, streamed text and detokenizer position, logprobs, priority (the grammar's state
    is replayed from the output)."""
    gen = seq.generator
    return {
        "version": VERSION,
        "model": model_geometry(engine),
        "request_id": seq.request_id,
        "prompt": seq.prompt,
        "prompt_ids": seq.prompt_ids,
        "output_ids": seq.output_ids,
        "params": seq.params.model_dump(),
        "priority": seq.priority,
        "rng_state": gen.get_state().numpy().tobytes() if gen is not None else None,
        "text": seq.text,
        "emitted": seq.emitted,
        "logprobs": seq.logprobs,
        "top_logprobs": seq.top_logprobs,
        "num_cached_prompt": seq.num_cached_prompt,
        "num_evictions": seq.num_evictions,
        # its LoRA adapter (name, where it was loaded from, content digest), or None
        "lora": seq.lora.record() if seq.lora is not None else None,
    }


def record_adapter(engine: LLMEngine, lora: dict[str, Any] | None) -> Adapter | None:
    """The adapter a record's stream runs with, on this engine: the one loaded under its
    name, or loaded here from where the source loaded it. It must be the same adapter (its
    digest): KV and tokens computed under one adapter mean nothing under another."""
    if lora is None:
        return None
    name = lora["name"]
    ad = engine.adapters.get(name) if engine.adapters is not None else None
    if ad is None:  # from the same directory where this host sees it, else its source
        engine.add_lora(name, lora["path"] if os.path.isdir(lora["path"]) else lora["source"])
        ad = engine.resolve_lora(name)
    if ad.digest.hex() != lora["digest"]:
        raise InvalidRequestError(f"the stream's LoRA adapter {name!r} differs from the one "
                                  f"loaded here under that name ({ad.source})")
    return ad


def sequence_from_record(engine: LLMEngine, r: dict[str, Any],
                         request_id: str | None = None) -> Sequence:
    """The stream of a record (`stream_record`), checked against this engine's model, as it
    stood when the record was taken; not queued anywhere."""
    if r["model"] != model_geometry(engine):
        raise InvalidRequestError(
            f"snapshot is for a model with {r['model']}, this engine runs {model_geometry(engine)}")
    rid = request_id or r["request_id"]
    params = SamplingParams(**r["params"])
    adapter = record_adapter(engine, r.get("lora"))
    seq = engine.make_sequence(r["prompt_ids"], params, rid, r["priority"], adapter)
    try:
        _restore_sequence(seq, r)
    except BaseException:
        engine.discard(seq)
        raise
    return seq


def export_stream(engine: LLMEngine, request_id: str) -> bytes:
    """Park `request_id` (if it is running), serialize it, and remove it from `engine`."""
    sched = engine.scheduler
    seq = engine.seqs.get(request_id)
    if seq is None:
        raise InvalidRequestError(f"no unfinished request {request_id!r}")
    if seq in sched.running:
        sched.running.remove(seq)
        sched.park(seq)
    kv_bytes, kv_tokens, shape = b"", 0, [0]
    host = engine.kv.host
    parked = seq.parked_kv
    if parked is not None and host is not None and parked.saved_tokens:
        data = host.read(parked)
        kv_bytes = data.contiguous().view(torch.uint8).numpy().tobytes()
        kv_tokens, shape = parked.saved_tokens, list(data.shape)
    record = stream_record(engine, seq)
    record.update({
        "computed_tokens": parked.num_tokens if parked is not None else 0,
        "kv": {"tokens": kv_tokens, "block_size": engine.kv.block_size,
               "dtype": str(engine.runner.kv_dtype).removeprefix("torch."), "shape": shape,
               "data": kv_bytes},
    })
    out = msgpack.packb(record, use_bin_type=True)
    engine.seqs.pop(request_id, None)
    sched.remove(seq)  # after serializing: its host blocks may be reused from here on
    return out


def snapshot_without_kv(record: dict[str, Any]) -> bytes:
    """A snapshot of a stream from its request state alone (`stream_record`): the engine
    that imports it recomputes the KV (a hand-off whose copy failed)."""
    return msgpack.packb({**record, "computed_tokens": 0,
                          "kv": {"tokens": 0, "block_size": 0, "dtype": "", "shape": [0],
                                 "data": b""}}, use_bin_type=True)


def import_stream(engine: LLMEngine, data: bytes, request_id: str | None = None) -> str:
    """Queue a snapshot's stream as parked in `engine`; it resumes where it stopped."""
    try:
        r = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(r, dict) or r.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} stream snapshot")
    except Exception as e:
        raise InvalidRequestError(f"bad stream snapshot: {e}") from e
    seq = sequence_from_record(engine, r, request_id)
    rid = seq.request_id
    kv = r["kv"]
    parked = ParkedKV(r["computed_tokens"], block_size=engine.kv.block_size)
    host = engine.kv.host
    if host is not None and kv["tokens"] and kv["block_size"] == engine.kv.block_size:
        src = _DTYPES[kv["dtype"]]
        t = torch.frombuffer(bytearray(kv["data"]), dtype=torch.uint8).view(src).view(kv["shape"])
        n = kv["tokens"]
        hashes = hash_full_blocks(seq.all_ids[:n], engine.kv.block_size, parent=seq.kv_step.root)
        parked = host.adopt(t.to(host.kv.dtype), hashes, n)
        parked.num_tokens = r["computed_tokens"]
    seq.parked_kv = parked
    seq.status = Status.WAITING
    try:
        engine.add_sequence(seq)
    except Exception:
        if host is not None:
            host.release(parked)
        raise
    # add_sequence queued it as new; it belongs with the parked streams
    engine.scheduler.waiting.remove(seq)
    engine.scheduler.parked.append(seq)
    return rid


def _restore_sequence(seq: Sequence, r: dict[str, Any]) -> None:
    seq.prompt = r["prompt"]
    seq.set_output_ids(r["output_ids"])
    if seq.output_ids:
        seq.detok.step(seq.output_ids)  # bring the detokenizer's window to the same place
        if seq.grammar is not None:  # and the grammar to where the output left it
            seq.grammar.replay(seq.output_ids)
    seq.text = r["text"]
    seq.emitted = r["emitted"]
    seq.logprobs = r["logprobs"]
    seq.top_logprobs = [[tuple(x) for x in row] for row in r["top_logprobs"]] \
        if r["top_logprobs"] is not None else None
    seq.num_cached_prompt = r["num_cached_prompt"]
    seq.num_evictions = r["num_evictions"]
    if r["rng_state"] is not None and seq.generator is not None:
        state = torch.frombuffer(bytearray(r["rng_state"]), dtype=torch.uint8)
        seq.generator.set_state(state)
