"""Per-step logit work for guided streams: logit_bias, then the grammar's token bitmask.

Called by the engine between the forward pass and the sampler, only when a stream of the
step is guided, and touching only those streams' rows: unconstrained streams in the same
batch pay nothing. The masks of every constrained stream are filled in one batched call of
the grammar engine into one reused bitmask, which goes to the logits' device and is applied
there in place. On CUDA the forward's kernels are still running when this starts, so the
host fills the masks while the GPU computes.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.workers.engine.sequence import Sequence
    from kvserve.workers.structured.grammars import Grammars

_NEG_INF = -float("inf")


@torch.inference_mode()  # the runner's logits are inference tensors
def apply(logits: torch.Tensor, seqs: Seq[Sequence], grammars: Grammars) -> None:
    """Bias and mask `logits` (one row per entry of `seqs`) in place."""
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    rows: list[int] = []
    states = []
    for i, s in enumerate(seqs):
        if not s.guided:
            continue
        lb = s.params.logit_bias
        if lb:
            bias_rows.extend([i] * len(lb))
            bias_cols.extend(lb)
            bias_vals.extend(lb.values())
        if s.grammar is not None:
            rows.append(i)
            states.append(s.grammar)
    dev = logits.device
    if bias_rows:
        idx = (torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev))
        logits.index_put_(idx, torch.tensor(bias_vals, device=dev, dtype=logits.dtype),
                          accumulate=True)
    if states:
        grammars.mask(logits, rows, states)


def accept(seqs: Seq[Sequence], tokens: Seq[int]) -> None:
    """Advance the grammar of each constrained stream by its sampled token."""
    for s, tok in zip(seqs, tokens, strict=True):
        if s.grammar is not None and not s.grammar.accept(tok):
            # the mask allowed only tokens the grammar takes: this is a bug, not bad input
            s.grammar.broken = True
