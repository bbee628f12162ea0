"""The operator's autoscaling settings: ServeConfig's `autoscaling` block and the
`kvserve serve` flags that make it (the policy itself: router/autoscale.py)."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.router.autoscale import AutoscalingConfig


class AutoscalingSettings(BaseModel):
    """The worker pool follows the load between min_workers and max_workers."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    min_workers: int = Field(1, description="fewest workers; 0 lets the pool scale to zero "
                                            "(requests then wait for a worker to start)")
    max_workers: int = Field(1, description="most workers")
    upscale_delay_s: float = Field(
        30.0, description="how long the load must want more workers before one starts "
                          "(Ray Serve's meaning)")
    downscale_delay_s: float = Field(
        600.0, description="how long the load must want fewer workers before one is drained")
    downscale_to_zero_delay_s: float | None = Field(
        None, description="the same from one worker to none; None = downscale_delay_s")
    max_step: int = Field(1, description="workers added per decision at most (one is "
                                         "removed at a time)")
    upscale_kv_use: float = Field(
        0.9, description="KV demand over capacity that starts a worker: the device blocks "
                         "streams hold plus those parked streams need back")
    downscale_kv_use: float = Field(
        0.5, description="a worker is drained when the load would fit one worker fewer at "
                         "no more than this share of their KV and batch slots")
    upscale_waiting: float = Field(5.0, description="waiting requests per worker that start "
                                                    "a worker")
    upscale_ttft_s: float | None = Field(
        None, description="time-to-first-token p90 over ttft_window_s that starts a worker; "
                          "None = not a signal")
    ttft_window_s: float = Field(30.0, description="the window of that p90")
    max_queued_requests: int = Field(
        256, description="requests that wait at the router while no worker serves (scaled to "
                         "zero, or all starting); more get 503 / UNAVAILABLE with Retry-After")
    queue_timeout_s: float = Field(
        120.0, description="how long such a request waits for a worker before 503 / "
                           "UNAVAILABLE with Retry-After")
    drain_timeout_s: float = Field(
        600.0, description="a scale-down drain that has not moved every stream by then "
                           "leaves the worker serving")

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSettings:
        self.policy().check()
        return self

    def policy(self) -> AutoscalingConfig:
        return AutoscalingConfig(enabled=True, **self.model_dump())


# flag -> AutoscalingSettings field (the flags besides --min-workers / --max-workers)
FLAGS = {
    "--upscale-delay-s": "upscale_delay_s", "--downscale-delay-s": "downscale_delay_s",
    "--downscale-to-zero-delay-s": "downscale_to_zero_delay_s",
    "--autoscale-max-step": "max_step", "--upscale-kv-use": "upscale_kv_use",
    "--downscale-kv-use": "downscale_kv_use", "--upscale-waiting": "upscale_waiting",
    "--upscale-ttft-s": "upscale_ttft_s", "--ttft-window-s": "ttft_window_s",
    "--max-queued-requests": "max_queued_requests", "--queue-timeout-s": "queue_timeout_s",
}
INTS = {"max_step", "max_queued_requests"}


def add_autoscaling_args(parser: Any) -> None:
    g = parser.add_argument_group(
        "autoscaling (on with --min-workers or --max-workers; docs/serving.md, \"Autoscaling\")")
    g.add_argument("--min-workers", type=int, default=None,
                   help="fewest workers (0: scale to zero; requests then wait for one to start)")
    g.add_argument("--max-workers", type=int, default=None,
                   help="most workers (default: the larger of --workers and --min-workers)")
    for flag, name in FLAGS.items():
        field = AutoscalingSettings.model_fields[name]
        g.add_argument(flag, type=int if name in INTS else float, default=None,
                       dest=name, help=f"{field.description} (default {field.default})")


def autoscaling_from_args(a: argparse.Namespace) -> dict[str, Any] | None:
    """ServeConfig's `autoscaling` block from the flags; None when autoscaling is off.
    ValueError when a tuning flag comes without --min-workers / --max-workers."""
    tuned = {name: getattr(a, name) for name in FLAGS.values()
             if getattr(a, name, None) is not None}
    if a.min_workers is None and a.max_workers is None:
        if tuned:
            flag = next(f for f, n in FLAGS.items() if n in tuned)
            raise ValueError(f"{flag} tunes autoscaling, which is off: set --min-workers and/or "
                             "--max-workers")
        return None
    lo = 1 if a.min_workers is None else a.min_workers
    hi = a.max_workers if a.max_workers is not None else max(lo, a.workers or 1, 1)
    return {"min_workers": lo, "max_workers": hi, **tuned}
