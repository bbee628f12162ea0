"""AsyncLLMEngine: an asyncio streaming front for LLMEngine, stepping on its own thread.

The step loop runs in a background thread, so the event loop never waits for a
forward pass. Requests and aborts reach the loop through thread-safe inboxes and
are applied between steps; each step's outputs go back to the callers' event
loops with call_soon_threadsafe. Cancelling (or abandoning) the consumer of
`generate` aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvserve.config import EngineConfig
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams
from kvserve.workers.engine.engine import LLMEngine
from kvserve.workers.engine.sequence import Sequence

log = logging.getLogger(__name__)


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the consumer's loop is closed
            return False


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.tokenizer = self.engine.tokenizer
        self._adds: queue.SimpleQueue[tuple[Sequence, _Stream]] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._stats: dict[str, Any] = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    # ---- public API ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield incremental outputs (new tokens, text delta) until the request finishes.

        Bad input raises InvalidRequestError here, before anything is queued.
        """
        rid = request_id or uuid.uuid4().hex
        seq = self.engine.make_sequence(prompt, params, rid)
        stream = _Stream(asyncio.get_running_loop())
        self._adds.put((seq, stream))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        """The engine's counters as of the last step (read without stopping the loop)."""
        return dict(self._stats)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- the step loop (engine thread) ------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain()
            if not eng.has_unfinished():
                self._stats = eng.stats()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # keep serving: fail what was running, not the engine
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outs:
                st = self._streams.get(out.request_id)
                if st is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                if not st.put(out) and not out.finished:
                    eng.abort(out.request_id)
                    self._streams.pop(out.request_id, None)
            self._stats = eng.stats()
        self._fail_all(RuntimeError("engine shut down"))

    def _drain(self) -> None:
        eng = self.engine
        while True:
            try:
                seq, st = self._adds.get_nowait()
            except queue.Empty:
                break
            try:
                eng.add_sequence(seq)
            except Exception as e:
                st.put(e)
                continue
            self._streams[seq.request_id] = st
        # after the adds: a request cancelled right after it was queued is dropped here
        while True:
            try:
                rid = self._aborts.get_nowait()
            except queue.Empty:
                break
            eng.abort(rid)
            self._streams.pop(rid, None)

    def _fail_all(self, err: BaseException) -> None:
        for rid, st in list(self._streams.items()):
            self.engine.abort(rid)
            st.put(err)
        self._streams.clear()
