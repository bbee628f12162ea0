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


def grammar_prefix(seq: Sequence, draft: list[int]) -> list[int]:
    """The longest prefix of proposed tokens `draft` the stream's grammar accepts without
    ending (its matcher is left where it was)."""
    g = seq.grammar
    if g is None:
        return draft
    m = g.matcher
    n = 0
    for t in draft:
        if not m.accept_token(t):
            break
        if m.is_terminated():  # the end is the target's to choose (no mask after it)
            m.rollback(1)
            break
        n += 1
    if n:
        m.rollback(n)
    return draft[:n]


@torch.inference_mode()
def apply_drafts(logits: torch.Tensor, seqs: Seq[Sequence], drafts: Seq[list[int]],
                 grammars: Grammars) -> None:
    """As `apply`, for a step verifying proposals: stream i owns `len(drafts[i]) + 1`
    consecutive rows, and its row j is biased as every row and masked by its grammar after
    the stream's first j proposals."""
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    rows: list[int] = []
    states = []
    row_drafts: list[list[int]] = []
    at = 0
    for s, d in zip(seqs, drafts, strict=True):
        n = len(d) + 1
        if s.guided:
            lb = s.params.logit_bias
            if lb:
                for r in range(at, at + n):
                    bias_rows.extend([r] * len(lb))
                    bias_cols.extend(lb)
                    bias_vals.extend(lb.values())
            if s.grammar is not None:
                rows.append(at)
                states.append(s.grammar)
                row_drafts.append(d)
        at += n
    dev = logits.device
    if bias_rows:
        idx = (torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev))
        logits.index_put_(idx, torch.tensor(bias_vals, device=dev, dtype=logits.dtype),
                          accumulate=True)
    if states:
        grammars.mask(logits, rows, states, row_drafts)
