"""What the router shows of a worker's life: "starting", "waiting for resources: {CPU: 1}" (no
node has room for it yet, router/placement.py), "downloading <model>: <done> of <total>
(<pct>%, <i>/<n> files)" (a Hub model fetched into the node's cache), "loading", "capturing graphs
i/n", "ready", "restarting" (it stopped answering; Ray brings it back), "failed: why" (its
start-up failed, or Ray did not place it within the placement timeout).

The worker reports its start-up stages itself (it answers no call before its model is
loaded and its CUDA graphs captured); the router's polls tell when it stopped answering.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerState:
    state: str = "starting"
    load_s: float = 0.0  # the last start-up's seconds: model load and graph captures
    incarnation: str = ""

    def report(self, incarnation: str, state: str, load_s: float) -> None:
        self.incarnation, self.state = incarnation, state
        if load_s:
            self.load_s = load_s

    def unreported(self) -> bool:
        """Nothing heard from the worker yet: its state is the router's to set."""
        return self.state == "starting" or self.state.startswith("waiting for resources")

    def ready(self, load_s: float) -> None:
        self.state = "ready"
        if load_s:
            self.load_s = load_s

    def answered(self) -> None:
        """A poll came back: a worker only answers once it is ready."""
        self.state = "ready"

    def lost(self) -> None:
        """A poll failed: the worker died or is being restarted."""
        if self.state == "ready":
            self.state = "restarting"
