"""A family's view of the loaded weights: tensors by HF name, fused linears, norms."""

from __future__ import annotations

import torch

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.loading.quant_format import QuantizedWeight, concat_rows
from kvserve.workers.model.layers.norm import RMSNorm
from kvserve.workers.model.quant_linear import Linear


class Weights:
    """Weights on the model's device and dtype, with the raw GGUF blocks the CPU kernel
    reads (`quantized`, float32 CPU runs only; `lib` is that kernel or None)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, quantized: dict[str, QuantizedWeight] | None,
                 lib: object | None) -> None:
        self.cfg = cfg
        self.w = {k: t.to(device=device, dtype=dtype) for k, t in weights.items()}
        self.qw = quantized or {}
        self.lib = lib

    def __contains__(self, name: str) -> bool:
        return name in self.w

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.w[name]
        except KeyError:
            raise ModelLoadError(f"{self.cfg.name or 'model'}: missing weight {name}") from None

    def linear(self, *names: str, bias: tuple[str, ...] | None = None) -> Linear:
        """One matmul for the weights `names` stacked by rows (e.g. q, k, v), with the
        concatenated biases `bias` if given."""
        weight = self.get(names[0]) if len(names) == 1 else torch.cat([self.get(n) for n in names])
        b = None
        if bias is not None:
            b = torch.cat([self.get(n) for n in bias])
        return Linear(weight, b, concat_rows([self.qw.get(n) for n in names]), self.lib)

    def norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.get(name), self.cfg.rms_norm_eps, self.cfg.norm_offset)
