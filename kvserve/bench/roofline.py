"""The decode roofline on CUDA: the bytes a decode step must read (every weight once,
plus each stream's attended KV) over the device's measured copy bandwidth.

A decode step is memory-bound: its time cannot be below (weight bytes + KV bytes read)
/ bandwidth. The bandwidth is measured, not taken from a data sheet: a device-to-device
copy of a large buffer (read + write bytes over CUDA-event time). `fraction` is the
measured tokens/s over that bound.
"""

from __future__ import annotations

from typing import Any

import torch


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second)."""
    if device.type != "cuda":
        raise ValueError("the roofline is measured on CUDA devices only")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    return 2 * nbytes * reps / seconds / 1e9


def weight_bytes(model: Any) -> int:
    """Bytes of the weights one decode step reads: every tensor of every layer (norms,
    attention, MLP or experts, biases), the final norm and the LM head (the embedding
    table is only indexed, a row per token)."""
    spans: list[tuple[int, int]] = []
    _collect_tensors([model.norm, model.lm_head, *model.layers], spans, set())
    # the union of the address ranges: a tied head, or an MoE block's stacked experts and
    # the per-expert views of them, count once whichever is reached first
    total, end = 0, 0
    for lo, hi in sorted(spans):
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


def _collect_tensors(obj: Any, spans: list[tuple[int, int]], visited: set[int]) -> None:
    """The address ranges of the tensors reachable from `obj`'s attributes."""
    from kvserve.workers.model.layers.rope import RotaryEmbedding
    from kvserve.workers.model.lora import LoRALinear
    from kvserve.workers.model.quant_linear import Linear

    if isinstance(obj, torch.Tensor):
        if obj.numel():
            extent = 1 + sum((n - 1) * st for n, st in zip(obj.shape, obj.stride(), strict=True))
            spans.append((obj.data_ptr(), obj.data_ptr() + extent * obj.element_size()))
        return
    if id(obj) in visited or isinstance(obj, RotaryEmbedding):  # rope tables are not weights
        return
    visited.add(id(obj))
    if isinstance(obj, Linear):  # its weight and bias (not its quantized copy's raw rows)
        items = [obj.weight, obj.bias]
    elif isinstance(obj, LoRALinear):  # the base linear; adapter slots are read per adapter row
        items = [obj.base]
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return
    for item in items:
        _collect_tensors(item, spans, visited)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def decode_roofline(weights: int, kv_per_token: int, batch: int, mean_context: float,
                    gbps: float) -> float:
    """Upper bound on decode tokens/s for `batch` streams attending `mean_context` tokens."""
    step_bytes = weights + batch * mean_context * kv_per_token
    return batch * gbps * 1e9 / step_bytes


def roofline_for(runner: Any, gbps: float, batch: int, mean_context: float) -> float:
    cfg = runner.model_config
    kvpt = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runner.kv_dtype)
    return decode_roofline(weight_bytes(runner.model), kvpt, batch, mean_context, gbps)
