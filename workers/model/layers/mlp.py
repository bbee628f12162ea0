"""The feed-forward block of a decoder layer.

`MLP` is the interface a layer calls: dense gated MLPs (SiLU for Llama, Qwen and Phi;
GeGLU with tanh GELU for Gemma) implement it here, a Mixture-of-Experts block
implements the same call over its experts.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kvserve.workers.model.layers.parallel import ReducedLinear
from kvserve.workers.model.quant_linear import Linear

ACTIVATIONS = ("silu", "gelu_tanh")


class MLP(Protocol):
    def __call__(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]. `fused`: the step may use the CUDA Triton kernels."""


class GatedMLP:
    """down(act(gate(x)) * up(x)), gate and up in one matmul ([gate | up] rows)."""

    # CPU float32 with the C decode step: its activation (bound by workers/model/cpu_decode.py)
    lib: Any = None

    def __init__(self, gate_up: Linear, down: Linear | ReducedLinear, intermediate: int,
                 act: str = "silu") -> None:
        """`intermediate`: the width of gate (and of up) in `gate_up`; a tensor-parallel
        rank's share of the model's."""
        if act not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {act!r}")
        self.gate_up = gate_up
        self.down = down
        self.inter = intermediate
        self.act = act

    def __call__(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gu = self.gate_up(x)
        if self.lib is not None and gu.dtype == torch.float32 and gu.device.type == "cpu" \
                and gu.dim() == 2 and gu.stride(-1) == 1:
            out = torch.empty((gu.shape[0], self.inter), dtype=torch.float32)
            self.lib.ds_act_rows(gu.data_ptr(), gu.shape[0], self.inter, gu.stride(0), out.data_ptr(),
                                 0 if self.act == "silu" else 1, torch.get_num_threads())
            return self.down(out)
        if fused and self.act == "silu":
            from kvserve.workers.model.triton_fused import silu_mul

            return self.down(silu_mul(gu))
        gate, up = gu.split([self.inter, self.inter], dim=-1)
        if self.act == "silu":
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(gate, approximate="tanh") * up)
