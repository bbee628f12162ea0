"""`kvserve bench migrate`: what a client sees when its stream moves, live against stop-and-copy.

A service of two workers (started here, every engine step sent to the client) serves one
greedy stream at a time whose prompt has the context length under test. Once the stream
has produced `--before` tokens, an operator's MoveStream moves it to the other worker, live
(pre-copy rounds while it decodes, then the final stage) or by snapshot (stop-and-copy),
the two methods alternating at each context so that the machine's drift weighs on both.
Per move it records, from the client's own token arrival times:

- the stall: the time between the last token from the source worker and the first one
  from the target, and that time in decode steps (the median gap between tokens before
  the move);
- the source's decode step during the pre-copy rounds against before the move (the
  overhead the rounds cost it), from the gaps between its tokens in each window;
- the server's own figures: stall (the stream on neither worker), KV bytes, rounds.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import uuid
from typing import Any

DEFAULT_CONTEXTS = "256,1024,4096,7680"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("migrate", help="a stream's stall when it moves, live vs stop-and-copy")
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", default=DEFAULT_CONTEXTS,
                   help="prompt lengths (tokens) of the moved stream")
    p.add_argument("--rounds", type=int, default=2, help="moves per method and context")
    p.add_argument("--before", type=int, default=48,
                   help="tokens generated before the move (the step-time baseline)")
    p.add_argument("--after", type=int, default=16,
                   help="tokens read from the target after the move (the stream, as long as "
                        "the context allows, is then cancelled)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="each worker's pool (default: the longest context and 1024 more)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: the cores divided by 2)")
    p.add_argument("--copy-share", type=float, default=None,
                   help="share of the source's step time a live round copies for "
                        "(ServeConfig.live_move_copy_share)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    p.set_defaults(func=run)


def run(a: Any) -> int:
    from kvserve.bench.common import machine_info, random_prompts, write_json
    from kvserve.bench.serve_service import start_service
    from kvserve.config import EngineConfig
    from kvserve.hardware import available_cores

    contexts = [int(x) for x in a.contexts.split(",") if x.strip()]
    threads = a.threads or max(1, available_cores() // 2)
    kv = a.kv_cache_tokens or max(contexts) + 1024
    engine = EngineConfig(model=a.model, kv_cache_tokens=kv, num_threads=threads)
    # the planner off: only the bench's own moves happen
    extra = {"live_move_copy_share": a.copy_share} if a.copy_share else {}
    svc = start_service(engine, stream_interval_ms=0, num_workers=2, migration=False, **extra)
    rows: list[dict[str, Any]] = []
    try:
        from kvserve.protos import kvserve_pb2 as pb

        stub = _stub(svc)
        vocab = 40000
        svc_context = stub.ListModels(pb.ListModelsRequest()).models[0].max_model_len
        for ctx in contexts:
            prompts = random_prompts(2 * a.rounds, ctx, vocab, a.seed + ctx)
            for r in range(a.rounds):
                for k, method in enumerate(("live", "snapshot") if r % 2 == 0
                                           else ("snapshot", "live")):
                    row = _one(stub, pb, prompts[2 * r + k], method, a.before, a.after,
                               svc_context - ctx - 1)
                    row.update(context=ctx, round=r)
                    rows.append(row)
                    print(f"bench migrate: context {ctx:5d} {method:8s} stall "
                          f"{row['client_stall_ms']:7.1f} ms ({row['stall_steps']:.2f} steps), "
                          f"server {row['server_stall_ms']:7.1f} ms, {row['rounds']} rounds, "
                          f"{row['bytes'] / 2**20:.1f} MiB, pre-copy step "
                          f"{row['precopy_overhead_pct']:+.1f}%", file=sys.stderr, flush=True)
    finally:
        svc.stop()
    table = _table(rows, contexts)
    _print(table)
    write_json(a.json, {"bench": "migrate", "machine": machine_info(threads),
                        "settings": vars(a) | {"func": None}, "moves": rows, "table": table})
    return 0


def _stub(svc: Any) -> Any:
    import grpc

    from kvserve.protos import kvserve_pb2_grpc

    ch = grpc.insecure_channel(f"127.0.0.1:{svc.port('grpc')}",
                               options=[("grpc.max_receive_message_length", 64 << 20)])
    return kvserve_pb2_grpc.KVServeStub(ch)


def _one(stub: Any, pb: Any, prompt: list[int], method: str, before: int, after: int,
         room: int) -> dict[str, Any]:
    """Serve one stream and move it after `before` tokens; the client's view of the move.
    The stream may run to the context (`room` tokens): the pre-copy rounds take a step each,
    and it is cancelled once `after` tokens came from the target."""
    rid = f"mig-{uuid.uuid4().hex[:10]}"
    sampling = pb.SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    stream = stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling,
                                                    request_id=rid), timeout=3600)
    arrivals: list[tuple[float, str, int]] = []  # (time, worker, tokens in the chunk)
    move: dict[str, Any] = {}

    def do_move() -> None:
        move["t0"] = time.perf_counter()
        try:
            move["res"] = stub.MoveStream(pb.MoveStreamRequest(
                request_id=rid, stop_and_copy=method == "snapshot"), timeout=600)
        except Exception as e:  # reported in the row
            move["error"] = str(e)
        move["t1"] = time.perf_counter()

    mover: threading.Thread | None = None
    n = 0
    first: str | None = None
    moved_tokens = 0
    for chunk in stream:
        arrivals.append((time.perf_counter(), chunk.worker_id, len(chunk.delta_token_ids)))
        n += len(chunk.delta_token_ids)
        first = first or chunk.worker_id
        if chunk.worker_id != first:
            moved_tokens += len(chunk.delta_token_ids)
            if moved_tokens >= after:
                stream.cancel()
                break
        if mover is None and n >= before:
            mover = threading.Thread(target=do_move)
            mover.start()
    if mover is not None:
        mover.join()
    if "error" in move:
        raise RuntimeError(f"the move of {rid} ({method}) failed: {move['error']}")
    res = move["res"]
    src = res.from_worker
    gaps = [(t1 - t0, t1) for (t0, *_), (t1, *_) in zip(arrivals, arrivals[1:], strict=False)]
    t_move = move["t0"]
    base = [g for g, t in gaps if t <= t_move][-32:]
    last_src = max(t for t, w, _ in arrivals if w == src)
    first_dst = min(t for t, w, _ in arrivals if w != src)
    during = [g for g, t in gaps if t_move < t <= last_src]
    step = statistics.median(base) if base else float("nan")
    stall = first_dst - last_src
    overhead = (statistics.mean(during) / statistics.mean(base) - 1) * 100 \
        if during and base else 0.0
    return {"method": res.method, "client_stall_ms": stall * 1e3,
            "stall_steps": stall / step if step else float("nan"), "step_ms": step * 1e3,
            "server_stall_ms": res.stall_ms, "bytes": res.bytes, "rounds": res.rounds,
            "precopy_tokens": len(during), "precopy_overhead_pct": overhead,
            "move_call_ms": (move["t1"] - move["t0"]) * 1e3}


def _table(rows: list[dict[str, Any]], contexts: list[int]) -> list[dict[str, Any]]:
    out = []
    for ctx in contexts:
        for method in ("live", "snapshot"):
            rs = [r for r in rows if r["context"] == ctx and r["method"] == method]
            if not rs:
                continue

            def med(k: str, rs: list[dict[str, Any]] = rs) -> float:
                return statistics.median(r[k] for r in rs)

            out.append({"context": ctx, "method": method, "moves": len(rs),
                        "client_stall_ms": med("client_stall_ms"),
                        "stall_steps": med("stall_steps"), "step_ms": med("step_ms"),
                        "server_stall_ms": med("server_stall_ms"),
                        "mib": med("bytes") / 2**20, "rounds": med("rounds"),
                        "precopy_overhead_pct": med("precopy_overhead_pct")})
    return out


def _print(table: list[dict[str, Any]]) -> None:
    print("| context | method | client stall ms | in decode steps | step ms | server stall ms "
          "| MiB | rounds | source step during pre-copy |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for t in table:
        pre = f"{t['precopy_overhead_pct']:+.1f}%" if t["method"] == "live" else "-"
        print(f"| {t['context']} | {t['method']} | {t['client_stall_ms']:.1f} | "
              f"{t['stall_steps']:.2f} | {t['step_ms']:.1f} | {t['server_stall_ms']:.1f} | "
              f"{t['mib']:.1f} | {t['rounds']:g} | {pre} |")
