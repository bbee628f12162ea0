"""Several base models behind one endpoint: one Service (tokenizer, router, workers) per model.

A request's `model` picks the Service: a base model's served name, `base:adapter`, or a LoRA
adapter's name (adapters belong to the first model); empty or "default" is the first model.
A service of one model is the Service alone, with its names unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from kvserve.deploy.config import ServeConfig, model_router_name
from kvserve.deploy.errors import ServiceError
from kvserve.deploy.placement import check_placement
from kvserve.deploy.service import Service
from kvserve.router.lifecycle import kill_router
from kvserve.router.router import NAMESPACE

log = logging.getLogger(__name__)


def stale_model_routers(router_name: str, further: int) -> list[str]:
    """Routers named as further models of this app beyond the `further` it has now."""
    from ray.util import list_named_actors

    pattern = re.compile(re.escape(model_router_name(router_name, 0)).replace("model0",
                                                                              r"model(\d+)"))
    return sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and (m := pattern.fullmatch(a["name"]))
                  and int(m.group(1)) > further)


class BaseModels:
    def __init__(self, cfg: ServeConfig, services: list[Service] | None = None) -> None:
        """One Service per base model of `cfg` (`services`: those, made elsewhere)."""
        self.cfg = cfg
        if services is None:
            # every model's workers together must fit the nodes: checked once, before loads
            check_placement(cfg)
            services = [Service(c, placement_checked=True) for c in cfg.per_model()]
            # routers of models a former deployment of this app had beyond these (detached:
            # nothing else would stop them and their workers)
            for name in stale_model_routers(cfg.router_name, len(cfg.models)):
                log.warning("kvserve: stopping router %s: its model is no longer served", name)
                kill_router(name)
        self.services = services
        self.primary = services[0]
        for s in services:
            s.other_models = frozenset(x.model_name for x in services if x is not s)

    async def start(self) -> None:
        await asyncio.gather(*(s.start() for s in self.services))

    def by_name(self, name: str) -> Service | None:
        return next((s for s in self.services if s.model_name == name), None)

    async def pick(self, name: str | None) -> tuple[Service, str | None]:
        """The Service serving `name`, and the LoRA adapter it names (None: the base model);
        NOT_FOUND when no model or adapter has that name."""
        if len(self.services) == 1:
            return self.primary, await self.primary.resolve_model(name)
        if not name or name == "default":
            return self.primary, None
        if (svc := self.by_name(name)) is not None:
            return svc, None
        base, sep, _ = name.partition(":")
        candidates = [self.by_name(base)] if sep else self.services
        for svc in candidates:
            if svc is None or not (svc.cfg.loras or svc.cfg.enable_lora):
                continue
            try:
                return svc, await svc.resolve_model(name)
            except ServiceError as e:
                if e.kind != "not_found":
                    raise
        served = [n for s in self.services for n in (s.model_name, *s.loras)]
        raise ServiceError("not_found", f"model {name!r} is not served here; available: "
                                        f"{', '.join(repr(m) for m in served)}")

    def base(self, name: str | None) -> Service:
        """The Service of the base model `name` (operators' calls: drain, move); empty or
        "default" is the first model; NOT_FOUND naming the base models otherwise."""
        if not name or name == "default":
            return self.primary
        if (svc := self.by_name(name)) is not None:
            return svc
        raise ServiceError("not_found", f"no base model {name!r} is served here; base models: "
                                        f"{', '.join(repr(s.model_name) for s in self.services)}")

    async def refresh_models(self) -> None:
        await asyncio.gather(*(s.refresh_models() for s in self.services))

    def models(self) -> list[dict[str, Any]]:
        """Every base model, each followed by its LoRA adapters."""
        return [m for s in self.services for m in s.models()]

    async def server_info(self) -> dict[str, Any]:
        """The first model's info as before, and `models`: every model with its workers."""
        infos = await asyncio.gather(*(s.server_info() for s in self.services))
        out = dict(infos[0])
        out["models"] = [
            {"model": s.model_name, "root": s.cfg.model or s.model_name,
             "max_model_len": s.max_model_len, "routing_policy": i["routing_policy"],
             "workers": i["workers"], "autoscaling": i.get("autoscaling"),
             "loras": i.get("loras", [])}
            for s, i in zip(self.services, infos, strict=True)]
        return out

    def stop_requests(self, message: str) -> int:
        return sum(s.stop_requests(message) for s in self.services)
