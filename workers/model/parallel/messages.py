"""What rank 0 sends the other ranks of a tensor-parallel engine, and how tensors travel.

Messages are tuples whose first item names them (rank 0 -> rank r):
  ("step", StepMessage)                  run the step's forward (no answer: the logits
                                         reach rank 0 through the group)
  ("to_host", dev_ids, host_ids)         host-tier copies, in rank 0's order
  ("to_device", host_ids, dev_ids)
  ("write", host_ids, packed blocks)     a snapshot's blocks: this rank's heads
  ("read", host_ids)                     -> ("data", packed blocks)
  ("host", num_blocks)                   -> ("done",) once its host pool exists
  ("close",)
and from rank r: ("ready", pid) after its shard is loaded, ("error", kind, text) before it
exits on a failure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.workers.model.parallel.tables import TableDelta
from kvserve.workers.model.step_inputs import StepInputs

Packed = tuple[str, tuple[int, ...], bytes]


@dataclass
class StepMessage:
    """A step's inputs but the block-table array, which every rank mirrors (`tables`)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    rows: np.ndarray
    num_blocks: int
    tables: TableDelta
    sample_rows: np.ndarray | None = None  # a step verifying proposals (speculative decoding)
    verify: np.ndarray | None = None

    @classmethod
    def of(cls, step: StepInputs, tables: TableDelta) -> StepMessage:
        return cls(step.input_ids, step.positions, step.slot_mapping, step.logits_indices,
                   step.query_lens, step.context_lens, step.rows, step.num_blocks, tables,
                   step.sample_rows, step.verify)

    def inputs(self, array: np.ndarray) -> StepInputs:
        return StepInputs(self.input_ids, self.positions, self.slot_mapping, self.logits_indices,
                          self.query_lens, self.context_lens, self.rows, array, self.num_blocks,
                          self.sample_rows, self.verify)


def pack(t: torch.Tensor) -> Packed:
    """A host tensor as plain bytes (no shared-memory handles between the processes)."""
    t = t.detach().cpu().contiguous()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(torch.uint8).numpy().tobytes()


def unpack(p: Packed) -> torch.Tensor:
    dtype, shape, data = p
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).view(shape)
