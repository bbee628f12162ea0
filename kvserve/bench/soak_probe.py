"""What the soak samples (every process's RSS, the router's and workers' view, the ingress's
slots) and the faults it injects (kill a worker, the router, the ingress replica)."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

# process title prefix -> role (Ray sets the titles of its actor processes)
ROLES = (("ray::ServeController", "controller"), ("ray::ProxyActor", "proxy"),
         ("ray::ServeReplica", "ingress"), ("ray::RouterActor", "router"),
         ("ray::WorkerActor", "worker"), ("gcs_server", "gcs"), ("raylet", "raylet"),
         ("ray::IDLE", "idle_worker"))


def ray_processes() -> dict[int, str]:
    """pid -> role of every Ray process of this machine that the soak can tell apart."""
    import psutil

    out: dict[int, str] = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            title = " ".join(p.info["cmdline"] or ()) or p.info["name"] or ""
        except psutil.Error:
            continue
        for prefix, role in ROLES:
            if title.startswith(prefix) or (p.info["name"] or "").startswith(prefix):
                out[p.info["pid"]] = role
                break
    return out


def rss_by_process(pids: dict[int, str]) -> dict[str, float]:
    """'role:pid' -> RSS in MiB (processes that exited meanwhile are left out)."""
    import psutil

    out = {}
    for pid, role in pids.items():
        try:
            out[f"{role}:{pid}"] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            pass
    return out


class Probe:
    """Samples the service; `pids` is refreshed each time (restarted actors get new ones)."""

    def __init__(self, router: Any, http_url: str, api_key: str | None, own_pids: set[int]) -> None:
        self.router, self.http_url, self.api_key = router, http_url, api_key
        self.own_pids = own_pids  # the Ray processes of this service (a test shares the machine)

    def server_info(self) -> dict[str, Any]:
        req = urllib.request.Request(self.http_url + "/v1/server_info", headers=(
            {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}))
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def sample(self) -> dict[str, Any]:
        t = time.monotonic()
        procs = {pid: role for pid, role in ray_processes().items() if self._ours(pid)}
        s: dict[str, Any] = {"t": t, "rss_mib": rss_by_process(procs)}
        try:
            info = self.server_info()
        except Exception as e:  # the ingress or router is down (chaos): note it, go on
            s["error"] = str(e)[:200]
            return s
        s["ingress_slots"] = info.get("ingress", {}).get("slots")
        s["ingress_retries"] = info.get("ingress", {}).get("retries", 0)
        s["ingress_pick_waits"] = info.get("ingress", {}).get("pick_waits", 0)
        s["workers"] = [{
            "worker_id": w["worker_id"], "alive": w["alive"], "inflight": w["inflight"],
            "running": w["running"], "waiting": w["waiting"], "parked": w["parked"],
            "kv_used": w["kv_blocks_total"] - w["kv_blocks_free"], "kv_total": w["kv_blocks_total"],
            "host_used": int(w["stats"].get("host_blocks_used", 0)),
            "host_cached": int(w["stats"].get("host_blocks_cached", 0)),
            "host_mib": round((w["stats"].get("host_bytes_used", 0)
                               + w["stats"].get("host_bytes_cached", 0)) / 2**20, 1),
            "host_total": int(w["stats"].get("host_blocks_total", 0)),
            "evictions": int(w["stats"].get("evictions", 0)),
            "reconciled": w.get("reconciled_slots", 0), "late": w.get("late_releases", 0),
            "restarts": w["restarts"],
        } for w in info["workers"]]
        return s

    def _ours(self, pid: int) -> bool:
        import psutil

        if not self.own_pids:
            return True
        try:  # our Ray's processes descend from its raylet/GCS, which descend from us
            return any(a.pid in self.own_pids for a in psutil.Process(pid).parents())
        except psutil.Error:
            return False


def idle_check(probe: Probe, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the service is idle; return what is still held (all zero when clean)."""
    deadline = time.monotonic() + timeout
    while True:
        s = probe.sample()
        if "workers" in s:
            held = {"inflight": sum(w["inflight"] for w in s["workers"]),
                    "running": sum(w["running"] + w["waiting"] for w in s["workers"]),
                    "parked": sum(w["parked"] for w in s["workers"]),
                    "kv_blocks_used": sum(w["kv_used"] for w in s["workers"]),
                    "ingress_slots": s["ingress_slots"] or 0,
                    "workers_alive": all(w["alive"] for w in s["workers"])}
            clean = held["workers_alive"] and not any(
                v for k, v in held.items() if k != "workers_alive")
            # slots the router had to drop itself (a release that never came); not a leak
            # left behind, but each one is a bug in the ingress's own accounting
            held["router_corrections"] = sum(w["reconciled"] for w in s["workers"])
            held["late_releases"] = sum(w["late"] for w in s["workers"])
            if clean or time.monotonic() > deadline:
                return {**held, "clean": clean, "waited_s": round(timeout - (deadline - time.monotonic()), 1)}
        elif time.monotonic() > deadline:
            return {"clean": False, "error": s.get("error")}
        time.sleep(0.5)


# ---- chaos -----------------------------------------------------------------------------------
def kill(what: str, router: Any) -> str:
    """Kill one part the way a crash would; Ray (or Serve) restarts it. Returns what died."""
    import ray

    if what == "worker":
        worker = ray.get(router.workers.remote())[0]
        ray.kill(worker, no_restart=False)
        return "worker-0 actor (Ray restarts it)"
    if what == "router":
        ray.kill(router, no_restart=False)
        return "router actor (Ray restarts it; it starts new workers)"
    if what == "ingress":
        from ray.util import list_named_actors

        names = [a for a in list_named_actors(all_namespaces=True)
                 if "KVServeIngress" in a["name"] and "REPLICA" in a["name"].upper()]
        if not names:
            raise RuntimeError("no ingress replica actor found")
        a = names[0]
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
        return f"ingress replica {a['name']} (Serve starts a new one)"
    raise ValueError(f"unknown chaos target {what!r}: worker, router or ingress")
