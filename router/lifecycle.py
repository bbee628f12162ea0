"""The router's lifetime: one detached, named actor per Ray cluster, outliving the ingress.

The router is detached so that an ingress replica's death (Serve replaces it) does not take
the router and the workers it owns down with it: the new replica finds the same router by
name. Being detached, it is never cleaned up by Ray on its own: `kill_router` does that
(`kvserve serve`'s shutdown, test fixtures), and a deployment with a different router
configuration replaces it (the router keeps its configuration's digest). A deployment that
changes only the worker count resizes it instead: the workers it loses are drained (their
streams move to the others) rather than killed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvserve.router.config import RouterConfig
from kvserve.router.router import NAMESPACE, ROUTER_NAME, RouterActor, worker_actor_name

log = logging.getLogger(__name__)

NAME_FREE_TIMEOUT_S = 60.0  # how long a killed router's name may take to be released
STOP_WORKERS_TIMEOUT_S = 30.0  # a router about to be killed stops its workers within this
# The router runs on the head node, which lives as long as the cluster: on a worker node
# that is lost (scaled down, pre-empted) it would die, and its restart would start new
# workers, dropping every stream and cache. Ray gives every head node this resource.
ON_HEAD = {"node:__internal_head__": 0.001}


def find_router(name: str = ROUTER_NAME) -> Any | None:
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def get_or_create_router(router_config: RouterConfig, name: str = ROUTER_NAME) -> Any:
    """The router for this configuration: the running one if its configuration is the same
    (resized if only the worker count differs), else a new one (the old router and its
    workers are killed first)."""
    import ray
    from ray.exceptions import RayActorError

    digest = router_config.digest()
    old = find_router(name)
    if old is not None:
        try:
            if ray.get(old.config_digest.remote(), timeout=120) == digest:
                return old
            if ray.get(old.shape_digest.remote(), timeout=120) == router_config.shape_digest():
                res = ray.get(old.resize.remote(router_config.num_workers,
                                                router_config.autoscaling), timeout=120)
                log.warning("router: the worker count or autoscaling changed (%d workers, "
                            "autoscaling %s); draining workers %s, started workers %s",
                            router_config.num_workers, router_config.autoscaling or "off",
                            res["draining"], res["started"])
                return old
            log.warning("router: the configuration changed; replacing the router and its workers")
        except (RayActorError, ray.exceptions.GetTimeoutError):
            log.warning("router: the running router does not answer; replacing it")
        kill_router(name)
    return ray.remote(RouterActor).options(
        name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=-1, max_concurrency=1000, resources=ON_HEAD,
    ).remote(router_config.to_dict())


def kill_router(name: str = ROUTER_NAME) -> bool:
    """Kill the router and its workers (they would die with it, their owner, a little
    later); returns whether a router ran. Waits until their names are free, so a new router
    and its workers can take them."""
    import ray

    router = find_router(name)
    if router is None:
        return False
    try:  # its workers' placement groups go first (best effort: the router may be stuck)
        ray.get(router.stop_workers.remote(), timeout=STOP_WORKERS_TIMEOUT_S)
    except Exception as e:
        log.warning("router %s did not stop its workers (%s); killing it", name, e)
    ray.kill(router, no_restart=True)
    for w in worker_names(name):
        try:
            ray.kill(ray.get_actor(w, namespace=NAMESPACE), no_restart=True)
        except ValueError:  # gone meanwhile
            pass
    deadline = time.monotonic() + NAME_FREE_TIMEOUT_S
    while find_router(name) is not None or worker_names(name):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the killed router {name!r} or its workers' names were not "
                               "released")
        time.sleep(0.2)
    return True


def worker_names(router_name: str = ROUTER_NAME) -> list[str]:
    """Names of the live worker actors of the router `router_name`."""
    from ray.util import list_named_actors

    prefix = worker_actor_name(router_name, 0).removesuffix("0")
    return sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)
                  and a["name"][len(prefix):].isdigit())
