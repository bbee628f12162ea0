"""LoRA on the model's linears: device slots for adapters and the batched product of a step.

Each adapted linear (per layer: the fused `qkv`, `o`, the fused `gate_up` and `down`) gets a
`LoRALinear` around it and two slot buffers, A [slots, R, in] and B [slots, R, out] (R: every
part of the linear at `max_lora_rank`), allocated once. Loading an adapter into a slot copies
its host tensors (`loading/lora.py`: stacked A, block-diagonal scaled B) into the first r
rows of each, where r is the adapter's own total rank for that linear; nothing reads past r.

A step's streams each name a slot or none (the base). The rows of one adapter are computed
together and only at that adapter's rank:
- the torch path (the CPU, and CUDA without Triton): for each adapter in the step, its token
  rows (a slice where its streams are contiguous, which the scheduler arranges by keeping
  running streams grouped by adapter; else gathered by index) go through `x @ A.T` and
  `@ B`, added to the base output in place. Rows of the base cost nothing. There is no
  padding to the largest rank in the batch: an adapter of rank 8 beside one of rank 64 does
  rank-8 work.
- CUDA with Triton (`triton_lora.py`): one shrink and one expand launch per linear over every
  token, each row reading its slot's rank from a table on the device; a program whose rank
  block is past its row's rank returns at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.workers.loading.lora import LoRAWeights, linear_shapes, slot_ranks
from kvserve.workers.model.layers.decoder import DecoderModel
from kvserve.workers.model.layers.mlp import GatedMLP


@dataclass
class StepLoRA:
    """The adapters of one step: (slot, first row, end row) runs of contiguous token rows,
    (slot, row indices) for an adapter whose rows are scattered, and on the kernel path every
    token's slot (-1: the base) on the device."""

    runs: list[tuple[int, int, int]]
    scattered: list[tuple[int, torch.Tensor]]
    token_slots: torch.Tensor | None = None


class LoRALinear:
    """A linear whose output gets the LoRA delta of each row's adapter."""

    __slots__ = ("base", "owner", "a", "b", "ranks", "row")

    def __init__(self, base: object, owner: LoRASlots, a: torch.Tensor, b: torch.Tensor,
                 row: int) -> None:
        self.base = base
        self.owner = owner
        self.a, self.b = a, b  # [slots, R, in], [slots, R, out]
        self.ranks = [0] * a.shape[0]  # each slot's rank here (0: its adapter skips it)
        self.row = row  # this linear's row in the owner's device rank table

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight  # type: ignore[attr-defined]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # type: ignore[operator]
        step = self.owner.step
        if step is None:
            return out
        if step.token_slots is not None:
            from kvserve.workers.model.triton_lora import lora_expand, lora_shrink

            ranks = self.owner.rank_table[self.row]
            t = lora_shrink(x, self.a, ranks, step.token_slots)
            lora_expand(t, self.b, ranks, step.token_slots, out)
            return out
        ranks = self.ranks
        for slot, start, end in step.runs:
            r = ranks[slot]
            if r:
                t = torch.mm(x[start:end], self.a[slot, :r].t())
                out[start:end].addmm_(t, self.b[slot, :r])
        for slot, idx in step.scattered:
            r = ranks[slot]
            if r:
                t = torch.mm(x.index_select(0, idx), self.a[slot, :r].t())
                out.index_add_(0, idx, torch.mm(t, self.b[slot, :r]))
        return out


class LoRASlots:
    """The model's adapted linears and `max_loras` device slots for adapters."""

    def __init__(self, model: DecoderModel, max_loras: int, max_rank: int) -> None:
        cfg = model.cfg
        self.num_slots = max_loras
        self.max_rank = max_rank
        self.device, self.dtype = model.device, model.dtype
        shapes = linear_shapes(cfg)
        rows = slot_ranks(max_rank)
        self.linears: dict[tuple[int, str], LoRALinear] = {}
        for i, layer in enumerate(model.layers):
            # the attribute holding each adapted linear, named as `loading/lora.py` names it
            holders: list[tuple[str, object]] = [("qkv", layer.attn), ("o", layer.attn)]
            if isinstance(layer.mlp, GatedMLP):  # MoE blocks: attention only (loader refuses)
                holders += [("gate_up", layer.mlp), ("down", layer.mlp)]
            for name, holder in holders:
                shape = shapes[name]
                a = torch.zeros(max_loras, rows[name], shape.inputs, dtype=self.dtype, device=self.device)
                b = torch.zeros(max_loras, rows[name], shape.outputs, dtype=self.dtype, device=self.device)
                lin = LoRALinear(getattr(holder, name), self, a, b, len(self.linears))
                setattr(holder, name, lin)
                self.linears[(i, name)] = lin
        # every linear's slot ranks on the device, for the kernels (CUDA)
        self.rank_table = torch.zeros(len(self.linears), max_loras, dtype=torch.int32,
                                      device=self.device)
        self.kernels = self.device.type == "cuda" and _has_triton()
        self.step: StepLoRA | None = None
        self.nbytes = sum(lin.a.nbytes + lin.b.nbytes for lin in self.linears.values())
        self.loads = 0
        self.load_seconds = 0.0

    def fits(self, weights: LoRAWeights) -> str | None:
        """Why `weights` cannot go in a slot of this model, or None."""
        for key, (a, _) in weights.layers.items():
            lin = self.linears.get(key)
            if lin is None:
                return f"layer {key[0]} {key[1]} is not adapted in this model"
            if a.shape[0] > lin.a.shape[1]:
                return f"layer {key[0]} {key[1]}: rank {a.shape[0]} above the slot's {lin.a.shape[1]}"
        return None

    def load(self, slot: int, weights: LoRAWeights) -> float:
        """Copy an adapter's host tensors into `slot` (queued on the device's stream after the
        steps that may still read the slot's previous adapter); the host seconds it took."""
        t0 = time.perf_counter()
        ranks = np.zeros(len(self.linears), dtype=np.int32)
        blocking = self.device.type != "cuda"
        for key, lin in self.linears.items():
            ab = weights.layers.get(key)
            if ab is None:
                lin.ranks[slot] = 0
                continue
            a, b = ab
            r = a.shape[0]
            lin.a[slot, :r].copy_(a, non_blocking=not blocking)
            lin.b[slot, :r].copy_(b, non_blocking=not blocking)
            lin.ranks[slot] = ranks[lin.row] = r
        if self.kernels:
            self.rank_table[:, slot].copy_(torch.from_numpy(ranks), non_blocking=False)
        seconds = time.perf_counter() - t0
        self.loads += 1
        self.load_seconds += seconds
        return seconds

    def clear(self, slot: int) -> None:
        """The slot's adapter is gone: no linear reads it."""
        for lin in self.linears.values():
            lin.ranks[slot] = 0
        if self.kernels:
            self.rank_table[:, slot] = 0

    def set_step(self, stream_slots: np.ndarray | None, query_lens: np.ndarray) -> bool:
        """Arrange the next forward's adapters: `stream_slots[i]` is stream i's slot (-1: the
        base), `query_lens[i]` its tokens in the step. True when any row has an adapter."""
        if stream_slots is None or not (stream_slots >= 0).any():
            self.step = None
            return False
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        if self.kernels:
            token_slots = np.repeat(stream_slots.astype(np.int32), query_lens)
            self.step = StepLoRA([], [], torch.from_numpy(token_slots).to(self.device, non_blocking=True))
            return True
        # runs of consecutive streams with the same slot
        change = np.flatnonzero(np.diff(stream_slots)) + 1
        firsts = np.concatenate(([0], change))
        lasts = np.concatenate((change, [len(stream_slots)])) - 1
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for f, last in zip(firsts.tolist(), lasts.tolist(), strict=True):
            slot = int(stream_slots[f])
            if slot >= 0:
                by_slot.setdefault(slot, []).append((int(starts[f]), int(ends[last])))
        runs, scattered = [], []
        for slot, spans in by_slot.items():
            if len(spans) == 1:
                runs.append((slot, *spans[0]))
            else:
                idx = np.concatenate([np.arange(s, e) for s, e in spans])
                scattered.append((slot, torch.from_numpy(idx).to(self.device)))
        self.step = StepLoRA(runs, scattered)
        return True


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

