"""`kvserve bench matmul`: one quantized linear, the CPU candidates side by side.

The default model's linear shapes (SmolLM2-135M: fused QKV, O, fused gate/up, down, the tied
head) at a few activation row counts, each multiplied by every candidate the engine could
use on GGUF weights:

- `kvserve int8`: csrc/qgemm.c, 8-bit activations per 32 values x the blocks in place
  (cpu_matmul int8, the default).
- `kvserve exact`: csrc/qgemv.c, float32 activations x the blocks (up to 16 rows).
- `mkl fp32`: torch's F.linear on the dequantized float32 weight (MKL sgemm).
- `fbgemm int8` / `onednn int8`: torch's dynamically quantized Linear (8-bit weights per
  output channel, one 8-bit scale per activation row) on each quantized engine.
- `ggml`: llama.cpp's `ggml_mul_mat` on the same blocks through a built libggml
  (`--ggml DIR`), in graphs of `--graph` matmuls as llama.cpp runs a forward pass.

The weights are random blocks with sane scales (speed does not depend on the values).
Figures: microseconds per matmul (median of `--repeat` timed runs), GFLOP/s, and each
result's largest error against float64 on the dequantized weight (relative to its largest
value): what the candidate's activation rounding costs.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

from kvserve.bench.common import machine_info, write_json

# (name, N, K, qtype) of SmolLM2-135M-Instruct Q4_1's linears
SHAPES = [("qkv", 960, 576, "Q4_1"), ("o", 576, 576, "Q4_1"), ("gate_up", 3072, 576, "Q4_1"),
          ("down", 576, 1536, "Q4_1"), ("head", 49152, 576, "Q8_0")]


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("matmul", help="one quantized linear: kvserve's kernels, MKL, fbgemm, "
                                       "oneDNN and ggml side by side")
    p.add_argument("--rows", default="1,4,32,512", help="activation rows M (comma list)")
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                   help="comma list of: " + ", ".join(s[0] for s in SHAPES))
    p.add_argument("--qtype", default=None, help="weight type for every shape (default: the "
                   "model's: Q4_1, the head Q8_0); one of Q4_0, Q4_1, Q8_0, Q4_K, Q6_K")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--ggml", default=None, metavar="DIR",
                   help="a directory holding llama.cpp's libggml-base.so and libggml-cpu.so")
    p.add_argument("--graph", type=int, default=30,
                   help="ggml: matmuls per graph (one thread start per graph, as per forward pass)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_matmul)


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> Any:
    """Raw ggml rows [n, k / block * bytes]: random bytes with small fp16 scales."""
    import numpy as np

    from kvserve.workers.loading.quant_format import QTYPES

    rng = np.random.default_rng(seed)
    _, block, size = QTYPES[qtype]
    nb = n * k // block
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    half = (rng.standard_normal((nb, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 4)
    offset = {"Q6_K": 208}.get(qtype, 0)  # where the block's fp16 scale(s) sit
    width = 4 if qtype in ("Q4_1", "Q4_K") else 2
    raw[:, offset:offset + width] = half[:, :width]
    return raw.reshape(n, -1)


def _timed(fn: Callable[[], Any], repeat: int, inner: int) -> float:
    """Median seconds per call of fn over `repeat` runs of `inner` calls (after a warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


class Ggml:
    """ggml_mul_mat through ctypes on llama.cpp's shared libraries."""

    class _Init(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                    ("no_alloc", ctypes.c_bool)]

    IDS = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}

    def __init__(self, libdir: str) -> None:
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(os.path.join(libdir, "libggml-cpu.so"), mode=mode)
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        b, c = self.base, self.cpu
        b.ggml_init.argtypes, b.ggml_init.restype = [self._Init], vp
        b.ggml_free.argtypes = [vp]
        b.ggml_new_tensor_2d.argtypes, b.ggml_new_tensor_2d.restype = [vp, ctypes.c_int, i64, i64], vp
        b.ggml_get_data.argtypes, b.ggml_get_data.restype = [vp], vp
        b.ggml_nbytes.argtypes, b.ggml_nbytes.restype = [vp], ctypes.c_size_t
        b.ggml_mul_mat.argtypes, b.ggml_mul_mat.restype = [vp, vp, vp], vp
        b.ggml_new_graph.argtypes, b.ggml_new_graph.restype = [vp], vp
        b.ggml_build_forward_expand.argtypes = [vp, vp]
        c.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
        c.ggml_cpu_init()

    def runner(self, raw: Any, qtype: str, n: int, k: int, x: Any, graph: int,
               threads: int) -> tuple[Callable[[], Any], Callable[[], None]]:
        """A call computing `graph` matmuls of the blocks by x [M, K] in one graph (it
        returns the first one's [M, N]); and a function freeing the context."""
        import torch

        m = x.shape[0]
        mem = raw.nbytes + graph * (x.nbytes + 4 * m * n + 4096) + (m * k * 2 + (64 << 20))
        ctx = self.base.ggml_init(self._Init(mem, None, False))
        w = self.base.ggml_new_tensor_2d(ctx, self.IDS[qtype], k, n)
        assert self.base.ggml_nbytes(w) == raw.nbytes
        ctypes.memmove(self.base.ggml_get_data(w), raw.ctypes.data, raw.nbytes)
        gf = self.base.ggml_new_graph(ctx)
        outs = []
        for _ in range(graph):
            xt = self.base.ggml_new_tensor_2d(ctx, self.IDS["F32"], k, m)
            ctypes.memmove(self.base.ggml_get_data(xt), x.data_ptr(), x.numel() * 4)
            outs.append(self.base.ggml_mul_mat(ctx, w, xt))
            self.base.ggml_build_forward_expand(gf, outs[-1])

        def run() -> Any:
            if self.cpu.ggml_graph_compute_with_ctx(ctx, gf, threads) != 0:
                raise RuntimeError("ggml_graph_compute failed")
            y = torch.empty(m, n)
            ctypes.memmove(y.data_ptr(), self.base.ggml_get_data(outs[0]), y.numel() * 4)
            return y

        return run, lambda: self.base.ggml_free(ctx)


def cmd_matmul(a: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvserve.workers.loading.quant_format import QTYPES, QuantizedWeight
    from kvserve.workers.model.cpu_kernels import load_decode_step, load_qgemv
    from kvserve.workers.model.quant_linear import MAX_ROWS, qlinear, qlinear_int8

    warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated")
    torch.set_num_threads(a.threads)
    rows = [int(v) for v in a.rows.split(",")]
    wanted = a.shapes.split(",")
    shapes = [s for s in SHAPES if s[0] in wanted]
    if len(shapes) != len(wanted) or (a.qtype is not None and a.qtype not in QTYPES):
        print(f"unknown shape or type: {a.shapes} {a.qtype}", file=sys.stderr)
        return 2
    int8_lib, exact_lib = load_decode_step(), load_qgemv()
    ggml = Ggml(a.ggml) if a.ggml else None
    engines = [e for e in ("fbgemm", "onednn") if e in torch.backends.quantized.supported_engines]
    results: list[dict[str, Any]] = []
    header = ["shape", "type", "M", "kvserve int8", "kvserve exact", "mkl fp32",
              *(f"{e} int8" for e in engines), *(["ggml"] if ggml else [])]
    print("microseconds per matmul (GFLOP/s), e: largest error / largest |value| against the "
          "dequantized weight in float64")
    print(" | ".join(header))
    for name, n, k, qtype in shapes:
        qtype = a.qtype or qtype
        block = QTYPES[qtype][1]
        k = -(-k // block) * block
        raw = random_blocks(qtype, n, k)
        qw = QuantizedWeight(qtype, torch.from_numpy(raw), (n, k))
        wf = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).copy())
        for m in rows:
            x = torch.randn(m, k)
            inner = max(1, int(2e8 // max(1, 2 * m * n * k)))  # ~0.1 s of work per timed run
            exact_ok = exact_lib and m <= MAX_ROWS and qtype in ("Q4_0", "Q4_1", "Q8_0")
            cand: dict[str, Callable[[], Any] | None] = {
                "kvserve int8": partial(qlinear_int8, x, qw, int8_lib) if int8_lib else None,
                "kvserve exact": partial(qlinear, x, qw, exact_lib) if exact_ok else None,
                "mkl fp32": partial(F.linear, x, wf),
            }
            for eng in engines:
                torch.backends.quantized.engine = eng
                lin = torch.ao.nn.quantized.dynamic.Linear(k, n, dtype=torch.qint8)
                wq = torch.quantize_per_channel(wf, (wf.abs().amax(1) / 127).clamp(min=1e-8),
                                                torch.zeros(n, dtype=torch.long), 0, torch.qint8)
                lin.set_weight_bias(wq, None)
                cand[f"{eng} int8"] = partial(_on_engine, eng, lin, x)
            free = None
            if ggml is not None:
                run, free = ggml.runner(raw, qtype, n, k, x, a.graph, a.threads)
                cand["ggml"] = run
            row: dict[str, Any] = {"shape": name, "qtype": qtype, "M": m, "N": n, "K": k,
                                   "us": {}, "rel_err": {}}
            ref = x.double() @ wf.double().T
            cells = []
            for label in header[3:]:
                fn = cand.get(label)
                if fn is None:
                    cells.append("-")
                    continue
                err = float((fn().double() - ref).abs().max() / ref.abs().max())
                per = a.graph if label == "ggml" else 1
                sec = _timed(fn, a.repeat, max(1, inner // per)) / per
                row["us"][label], row["rel_err"][label] = sec * 1e6, err
                cells.append(f"{sec * 1e6:.0f} ({2 * m * n * k / sec / 1e9:.0f}) e{err:.0e}")
            if free is not None:
                free()
            results.append(row)
            print(" | ".join([name, qtype, str(m), *cells]), flush=True)
    write_json(a.json, {"bench": "matmul", "machine": machine_info(a.threads), "results": results})
    return 0


def _on_engine(engine: str, lin: Any, x: Any) -> Any:
    import torch

    torch.backends.quantized.engine = engine
    return lin(x)
