"""A family's view of the loaded weights: tensors by HF name, fused linears, norms."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.loader import held_weight
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.loading.quant_format import QuantizedWeight, concat_rows
from kvserve.workers.model.layers.norm import RMSNorm
from kvserve.workers.model.layers.parallel import ReducedLinear, TensorParallel
from kvserve.workers.model.quant_linear import Linear


class Weights:
    """Weights on the model's device and dtype, with the raw GGUF blocks the CPU kernel
    reads (`quantized`, float32 CPU runs only; `lib` is that kernel or None, `int8` whether
    it is the 8-bit-activation one).

    Tensors move to the device and dtype when first asked for. A linear the int8 kernel
    reads never asks for its float weight: a deferred one (loading/loader.py's
    ModelWeights) is then never made, and the model takes about its file's size in memory.

    A tensor-parallel rank's (`tp`) tensors are its shards as loaded: fused linears of them
    are its part of the fused matmul, row-parallel ones add the ranks' sums, the LM head's
    rows are padded to the same count on every rank (for the gather)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, quantized: dict[str, QuantizedWeight] | None,
                 lib: object | None, tp: TensorParallel | None = None, int8: bool = False) -> None:
        self.cfg = cfg
        self.device, self.dtype = device, dtype
        self.src = weights
        self.w: dict[str, torch.Tensor] = {}  # on the device, by name, as asked for
        self.qw = quantized or {}
        self.lib = lib
        self.int8 = int8
        self.tp = tp

    @property
    def heads(self) -> tuple[int, int]:
        """(query heads, KV heads) this rank computes."""
        if self.tp is None:
            return self.cfg.num_heads, self.cfg.num_kv_heads
        return self.tp.layout.num_heads, self.tp.layout.num_kv_heads

    def part(self, width: int) -> int:
        """This rank's share of a width split across the ranks (an MLP's intermediate)."""
        return width if self.tp is None else width // self.tp.layout.size

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results over the ranks (in place); the identity on one device."""
        return x if self.tp is None else self.tp.group.all_reduce(x)

    def __contains__(self, name: str) -> bool:
        return name in self.src

    def _held(self, name: str) -> torch.Tensor:
        """The tensor as loaded, a deferred one not made (a meta tensor of its shape)."""
        if name not in self.src:
            raise ModelLoadError(f"{self.cfg.name or 'model'}: missing weight {name}")
        return held_weight(self.src, name)

    def get(self, name: str) -> torch.Tensor:
        t = self.w.get(name)
        if t is None:
            self._held(name)  # a missing name is a ModelLoadError
            t = self.w[name] = self.src[name].to(device=self.device, dtype=self.dtype)
        return t

    def linear(self, *names: str, bias: tuple[str, ...] | None = None) -> Linear | ReducedLinear:
        """One matmul for the weights `names` stacked by rows (e.g. q, k, v), with the
        concatenated biases `bias` if given."""
        b = None
        if bias is not None:
            b = torch.cat([self.get(n) for n in bias])
        qs = [self.qw.get(n) for n in names]
        quant = concat_rows(qs)
        tp = self.tp
        if tp is None:
            # parts of different types (K-quant mixes: attn_v wider than q and k) stay apart
            parts = tuple(q for q in qs if q is not None) if quant is None and None not in qs else None
            if Linear.int8_reads_blocks(self.lib, self.device, self.dtype, self.int8, quant, parts):
                # the int8 kernel reads every row: the float weight is only its shape
                shapes = [self._held(n).shape for n in names]
                weight = torch.empty((sum(r for r, _ in shapes), shapes[0][1]), dtype=self.dtype, device="meta")
            else:
                weight = self._stacked(names)
            return Linear(weight, b, quant, self.lib, int8=self.int8, parts=parts)
        weight = self._stacked(names)
        layout = tp.layout
        if layout.vocab_parallel(names[0]) and weight.shape[0] < layout.vocab_per_rank:
            weight, quant = _pad_rows(weight, quant, layout.vocab_per_rank)
        linear = Linear(weight, b, quant, self.lib, int8=self.int8)
        return ReducedLinear(linear, tp.group) if layout.row_parallel(names[0]) else linear

    def _stacked(self, names: tuple[str, ...]) -> torch.Tensor:
        return self.get(names[0]) if len(names) == 1 else torch.cat([self.get(n) for n in names])

    def norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.get(name), self.cfg.rms_norm_eps, self.cfg.norm_offset)


def _pad_rows(weight: torch.Tensor, quant: QuantizedWeight | None,
              rows: int) -> tuple[torch.Tensor, QuantizedWeight | None]:
    """Zero rows up to `rows` (the last rank's vocabulary slice is the short one; zero ggml
    blocks dequantize to zeros too)."""
    extra = rows - weight.shape[0]
    weight = torch.cat([weight, weight.new_zeros((extra, weight.shape[1]))])
    if quant is not None:
        data = torch.cat([quant.data, quant.data.new_zeros((extra, quant.data.shape[1]))])
        quant = QuantizedWeight(quant.qtype, data, (rows, quant.shape[1]))
    return weight, quant
