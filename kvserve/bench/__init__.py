"""`kvserve bench ...`: benchmarks that print figures and can write them as JSON.

One module per bench, each with `add_parser(sub)`; heavy imports (torch, Ray) stay inside the
commands so that `kvserve bench X --help` is fast and needs neither. May import any kvserve part.
"""

from __future__ import annotations

import argparse

BENCHES = ("offline", "batched", "agreement", "attention", "serve", "throughput", "pressure",
           "multiturn", "soak", "hoststep", "moe", "tp", "migrate", "lora", "spec", "matmul")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    import importlib

    b = sub.add_parser("bench", help="benchmarks")
    b.set_defaults(func=lambda a: b.print_help() or 0)
    bsub = b.add_subparsers(dest="bench_command")
    for name in BENCHES:
        importlib.import_module(f"kvserve.bench.{name}").add_parser(bsub)
