"""The engine's LoRA adapters: names, a host-memory cache and the device slots.

- **Registered** adapters are known by name (`add`, `remove`); a request names one in its
  `model`. Registering reads and checks the adapter (`loading/lora.py`): a bad one is refused
  and nothing is kept.
- **Host cache** (`max_cpu_loras`): adapters in host memory (pinned on CUDA), least recently
  used dropped first. An adapter with live requests (waiting, running or parked) is never
  dropped, so bringing a request's adapter to a device slot is always a copy, never a disk
  read on the step thread; one dropped from host memory and asked for again is read from
  disk by the request's own thread (`pin`).
- **Device slots** (`max_loras`): the adapters the next steps can use. A running stream holds
  its adapter's slot; a slot whose streams all finished or were parked is taken by another
  adapter, least recently used first. A stream waits (others go ahead) while every slot is
  held by running streams of other adapters.
- `remove` unregisters at once (new requests get NOT_FOUND) and frees the adapter's memory
  once its last request has left.

The step thread (`acquire`, `release`) and request threads (`pin`, `add`, `remove`) share the
tables under one lock; disk reads happen outside it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.errors import AdapterError, NotFoundError
from kvserve.workers.loading.lora import LoRAWeights, load_adapter
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.model.lora import LoRASlots

log = logging.getLogger(__name__)


def adapter_root(digest: bytes) -> int:
    """The KV hash chain's root for an adapter's streams: blocks computed under it never
    match the base's (root 0) or another adapter's, on any worker."""
    h = hashlib.blake2b(b"kvserve-lora\0" + digest, digest_size=8).digest()
    return int.from_bytes(h, "little") or 1


@dataclass(eq=False)
class Adapter:
    name: str
    source: str  # the path (or Hub id) it was registered with
    path: str  # the local directory read
    digest: bytes
    rank: int
    modules: tuple[str, ...]
    nbytes: int
    weights: LoRAWeights | None = None  # the host copy (None: on disk only)
    slot: int = -1  # its device slot, or -1
    running: int = 0  # running streams using its slot
    users: int = 0  # live requests (their host pins)
    retired: bool = False  # unregistered; freed when its last request leaves
    loaded_at: float = field(default_factory=time.time)

    @property
    def root(self) -> int:
        return adapter_root(self.digest)

    def record(self) -> dict[str, Any]:
        """What a stream's snapshot or live move carries: enough for another engine to find
        or load the same adapter."""
        return {"name": self.name, "source": self.source, "path": self.path,
                "digest": self.digest.hex()}


class AdapterManager:
    def __init__(self, slots: LoRASlots, model: ModelConfig, max_cpu_loras: int,
                 dtype: torch.dtype) -> None:
        self.slots = slots
        self.model = model
        self.max_rank = slots.max_rank
        self.max_cpu = max_cpu_loras
        self.dtype = dtype
        self.pin_memory = slots.device.type == "cuda"
        self.lock = threading.Lock()
        self.by_name: dict[str, Adapter] = {}
        self.host: OrderedDict[int, Adapter] = OrderedDict()  # id -> adapter, LRU first
        self.in_slot: list[Adapter | None] = [None] * slots.num_slots
        self.slot_order: OrderedDict[int, None] = OrderedDict()  # slots, LRU first
        self.disk_loads = 0
        self.disk_seconds = 0.0
        self.slot_loads = 0
        self.slot_seconds = 0.0
        self.host_evictions = 0
        self.slot_evictions = 0

    # ---- registry (request threads) ----------------------------------------------------------
    def read(self, path: str) -> LoRAWeights:
        """Read and check an adapter from disk (no lock held)."""
        t0 = time.perf_counter()
        weights = load_adapter(path, self.model, self.max_rank, self.dtype)
        problem = self.slots.fits(weights)
        if problem is not None:
            raise AdapterError(f"LoRA adapter {path}: {problem}")
        if self.pin_memory:
            weights = weights.to(self.dtype, pin=True)
        with self.lock:
            self.disk_loads += 1
            self.disk_seconds += time.perf_counter() - t0
        return weights

    def add(self, name: str, path: str, source: str | None = None,
            weights: LoRAWeights | None = None) -> Adapter:
        """Register `name` (AdapterError when the adapter is bad or the name is taken by
        another adapter; the same adapter again is a no-op)."""
        if not name or not isinstance(name, str):
            raise AdapterError("a LoRA adapter needs a non-empty name")
        weights = weights or self.read(path)
        with self.lock:
            have = self.by_name.get(name)
            if have is not None:
                if have.digest == weights.digest:
                    return have
                raise AdapterError(f"LoRA adapter {name!r} is already loaded (from "
                                   f"{have.source}) with other weights; unload it first")
            ad = Adapter(name, source or path, weights.path, weights.digest, weights.rank,
                         weights.modules, weights.nbytes, weights)
            self.by_name[name] = ad
            self.host[id(ad)] = ad
            self._trim_host()
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, ad.source, ad.rank,
                 ", ".join(ad.modules))
        return ad

    def remove(self, name: str) -> Adapter:
        with self.lock:
            ad = self.by_name.pop(name, None)
            if ad is None:
                raise NotFoundError(f"no LoRA adapter named {name!r} is loaded")
            ad.retired = True
            if ad.users == 0:
                self._drop(ad)
        log.info("LoRA adapter %s unloaded%s", name,
                 f" (freed when its {ad.users} request(s) finish)" if ad.users else "")
        return ad

    def get(self, name: str) -> Adapter | None:
        return self.by_name.get(name)

    def resolve(self, name: str) -> Adapter:
        ad = self.by_name.get(name)
        if ad is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded")
        return ad

    def pin(self, ad: Adapter) -> None:
        """A request of `ad` is live: its host copy stays (read again from disk here, on the
        request's thread, if it was dropped)."""
        with self.lock:
            ad.users += 1
            have = ad.weights is not None
            if have:
                self.host.move_to_end(id(ad))
        if have:
            return
        try:
            weights = self.read(ad.path)
            if weights.digest != ad.digest:
                raise AdapterError(f"LoRA adapter {ad.name!r}: {ad.path} changed on disk since "
                                   "it was loaded; load it again under a new name")
        except BaseException:
            self.unpin(ad)
            raise
        with self.lock:
            if ad.weights is None:
                ad.weights = weights
                self.host[id(ad)] = ad
                self._trim_host()

    def unpin(self, ad: Adapter) -> None:
        with self.lock:
            ad.users -= 1
            assert ad.users >= 0, f"LoRA adapter {ad.name}: more unpins than pins"
            if ad.users == 0 and ad.retired:
                self._drop(ad)
            else:
                self._trim_host()

    # ---- device slots (the step thread) ------------------------------------------------------
    def acquire(self, ad: Adapter) -> int:
        """A slot holding `ad` for a stream about to run (copied in from host memory if it is
        not in one), or -1 when every slot is held by running streams of other adapters."""
        with self.lock:
            if ad.slot >= 0:
                ad.running += 1
                self.slot_order.move_to_end(ad.slot)
                return ad.slot
            slot = next((i for i, a in enumerate(self.in_slot) if a is None), -1)
            if slot < 0:
                slot = next((s for s in self.slot_order if self.in_slot[s].running == 0), -1)  # type: ignore[union-attr]
                if slot < 0:
                    return -1
                old = self.in_slot[slot]
                assert old is not None
                old.slot = -1
                self.slot_evictions += 1
            assert ad.weights is not None, f"LoRA adapter {ad.name} is not in host memory"
            self.slot_seconds += self.slots.load(slot, ad.weights)
            self.slot_loads += 1
            self.in_slot[slot] = ad
            ad.slot = slot
            ad.running = 1
            self.slot_order[slot] = None
            self.slot_order.move_to_end(slot)
            self.host.move_to_end(id(ad))
            return slot

    def release(self, ad: Adapter) -> None:
        """A stream of `ad` stopped running (finished, parked or moved): its slot may go to
        another adapter once no stream runs with it."""
        with self.lock:
            ad.running -= 1
            assert ad.running >= 0, f"LoRA adapter {ad.name}: more releases than acquires"

    # ---- internals (lock held) ---------------------------------------------------------------
    def _drop(self, ad: Adapter) -> None:
        """Forget an unregistered adapter with no requests left."""
        if ad.slot >= 0:
            self.slots.clear(ad.slot)
            self.in_slot[ad.slot] = None
            self.slot_order.pop(ad.slot, None)
            ad.slot = -1
        self.host.pop(id(ad), None)
        ad.weights = None

    def _trim_host(self) -> None:
        """Drop least recently used host copies beyond `max_cpu_loras` (never one with live
        requests; one in a device slot only after those without)."""
        over = len(self.host) - self.max_cpu
        if over <= 0:
            return
        for in_slot in (False, True):
            for ad in list(self.host.values()):
                if over <= 0:
                    return
                if ad.users or ad.running or (ad.slot >= 0) != in_slot:
                    continue
                if ad.slot >= 0:
                    self.slots.clear(ad.slot)
                    self.in_slot[ad.slot] = None
                    self.slot_order.pop(ad.slot, None)
                    ad.slot = -1
                self.host.pop(id(ad))
                ad.weights = None
                self.host_evictions += 1
                over -= 1

    # ---- reports -----------------------------------------------------------------------------
    def listing(self) -> list[dict[str, Any]]:
        """Registered adapters, for /v1/models, ListModels and the router."""
        with self.lock:
            return [{"name": a.name, "source": a.source, "rank": a.rank,
                     "modules": list(a.modules), "root": a.root,
                     "where": "device" if a.slot >= 0 else "host" if a.weights is not None
                     else "disk", "created": int(a.loaded_at)}
                    for a in self.by_name.values()]

    def held(self) -> dict[str, list[str]]:
        """Names in device slots and in host memory (the router's adapter affinity)."""
        with self.lock:
            return {"device": [a.name for a in self.in_slot if a is not None and not a.retired],
                    "host": [a.name for a in self.host.values() if not a.retired]}

    def stats(self) -> dict[str, float | int]:
        with self.lock:
            return {
                "lora_adapters": len(self.by_name),
                "lora_host_adapters": len(self.host),
                "lora_device_adapters": sum(a is not None for a in self.in_slot),
                "lora_slots": len(self.in_slot),
                "lora_host_bytes": sum(a.nbytes for a in self.host.values()),
                "lora_disk_loads": self.disk_loads,
                "lora_disk_load_seconds": self.disk_seconds,
                "lora_slot_loads": self.slot_loads,
                "lora_slot_load_seconds": self.slot_seconds,
                "lora_slot_evictions": self.slot_evictions,
                "lora_host_evictions": self.host_evictions,
            }
