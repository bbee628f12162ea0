"""The router's LoRA adapters: which the service serves, loaded on every worker alike.

The adapters of the configuration (`--lora`) are in every worker's engine settings, so a
worker has them from its start. One loaded at run time (`load`) goes to every serving
worker at once, all or none: if one refuses (a bad adapter, a name taken by another one) it
is unloaded from those that took it, and the caller gets that worker's reason. `unload`
goes to every worker too. A worker restarted by Ray starts with its configuration's
adapters only: each poll compares what a worker reports with this registry and loads what
it lacks (and unloads what was unloaded meanwhile), in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvserve.router.policy import WorkerView

log = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self, handles: list[Any], views: list[WorkerView]) -> None:
        self.handles, self.views = handles, views  # the router's lists (grown by resizes)
        self.known: dict[str, dict[str, Any]] = {}  # name -> description (source, rank, root)
        self._busy: set[str] = set()  # names being loaded or unloaded: not resynced meanwhile
        self._syncing: set[int] = set()  # workers being resynced
        self._lock = asyncio.Lock()
        self.initialized = False  # `started` ran (else: a restarted router not yet ready)

    async def learn(self, idx: int) -> None:
        """A restarted router asked before `ready`: take worker `idx`'s adapters (those of
        the configuration) as the served ones."""
        try:
            listing = await self.handles[idx].list_loras.remote()
        except Exception:
            return
        self.started([{"loras": listing}])

    def started(self, infos: list[dict[str, Any]]) -> None:
        """The configuration's adapters, as the first workers to answer loaded them."""
        self.initialized = True
        for info in infos:
            for ad in info.get("loras", []):
                desc = {k: v for k, v in ad.items() if k != "where"}
                self.known.setdefault(ad["name"], desc)

    async def load(self, name: str, source: str, live: list[int]) -> dict[str, Any]:
        if not live:
            return {"error": "no worker is available to load the adapter", "kind": "unavailable"}
        async with self._lock:
            if name in self.known and self.known[name]["source"] != source:
                return {"error": f"LoRA adapter {name!r} is already loaded (from "
                                 f"{self.known[name]['source']}); unload it first",
                        "kind": "invalid"}
            self._busy.add(name)
            try:
                had = {i for i in live if name in self.views[i].loras}
                res = await asyncio.gather(*(self.handles[i].add_lora.remote(name, source)
                                             for i in live), return_exceptions=True)
                bad = [(i, r) for i, r in zip(live, res, strict=True)
                       if isinstance(r, BaseException) or "error" in r]
                if bad:
                    took = [i for i, r in zip(live, res, strict=True)
                            if not isinstance(r, BaseException) and "error" not in r and i not in had]
                    await asyncio.gather(*(self.handles[i].remove_lora.remote(name) for i in took),
                                         return_exceptions=True)
                    i, r = bad[0]
                    if isinstance(r, BaseException):
                        return {"error": f"worker-{i} failed to load {name!r}: {r}",
                                "kind": "unavailable"}
                    return r
                desc = {**res[0], "created": int(time.time())}
                self.known[name] = desc
                for i in live:
                    self.views[i].loras.add(name)
                    self.views[i].lora_host.add(name)
                return desc
            finally:
                self._busy.discard(name)

    async def unload(self, name: str, live: list[int]) -> dict[str, Any]:
        async with self._lock:
            if name not in self.known:
                return {"error": f"no LoRA adapter named {name!r} is loaded", "kind": "not_found"}
            self._busy.add(name)
            try:
                del self.known[name]
                await asyncio.gather(*(self.handles[i].remove_lora.remote(name) for i in live),
                                     return_exceptions=True)
                for v in self.views:
                    v.loras.discard(name)
                    v.lora_device.discard(name)
                    v.lora_host.discard(name)
                return {"removed": name}
            finally:
                self._busy.discard(name)

    def listing(self) -> list[dict[str, Any]]:
        return [dict(d) for d in self.known.values()]

    @staticmethod
    def holders(views: list[WorkerView], name: str) -> list[WorkerView]:
        """The workers of `views` that have adapter `name` loaded, as their last poll (or a
        load) said: a worker restarted or added gets the adapters loaded at run time only
        after a poll, and a request naming one goes to the others meanwhile rather than to
        a worker that would answer NOT_FOUND. All of `views` when none has it."""
        have = [v for v in views if name in v.loras]
        return have or views

    def check(self, v: WorkerView) -> None:
        """After a poll of `v`: bring its adapters in line with the registry (background).
        Not before the registry knows the configuration's adapters (a router restarted and
        not yet ready would take every adapter for one unloaded)."""
        if not self.initialized:
            return
        missing = set(self.known) - v.loras - self._busy
        extra = v.loras - set(self.known) - self._busy
        if (missing or extra) and v.idx not in self._syncing:
            self._syncing.add(v.idx)
            asyncio.get_running_loop().create_task(self._sync(v.idx, missing, extra))

    async def _sync(self, idx: int, missing: set[str], extra: set[str]) -> None:
        try:
            h = self.handles[idx]
            for name in sorted(missing):
                desc = self.known.get(name)
                if desc is None:
                    continue
                res = await h.add_lora.remote(name, desc["source"])
                if "error" in res:
                    log.error("router: worker-%d could not load LoRA adapter %s again: %s",
                              idx, name, res["error"])
                else:
                    log.warning("router: loaded LoRA adapter %s on worker-%d again (it restarted)",
                                name, idx)
                    self.views[idx].loras.add(name)
            for name in sorted(extra):
                if name not in self.known:
                    await h.remove_lora.remote(name)
                    self.views[idx].loras.discard(name)
        except Exception:
            log.exception("router: bringing worker-%d's LoRA adapters in line failed", idx)
        finally:
            self._syncing.discard(idx)
