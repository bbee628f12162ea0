"""The model's side of tensor parallelism: a rank's layers work on its shard of each weight
(`loading/sharding.py`) and meet the other ranks where a result must be whole.

- Row-parallel linears (attention's o_proj, the MLP's down_proj) give partial sums: one
  all-reduce each (`ReducedLinear`). An MoE block adds its experts' partial sums once.
- The embedding is vocab-parallel: a rank looks up the tokens in its rows (zeros for the
  others) and the ranks add their rows up (one all-reduce of [T, hidden]).
- The LM head is vocab-parallel: each rank's logits of its vocabulary rows are gathered
  (one all-gather of [B, vocab / size]) and cut to the vocabulary.
A single-device model has none of this: no wrapper, no collective, no copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.workers.loading.sharding import ShardLayout
from kvserve.workers.model.parallel.group import ParallelGroup
from kvserve.workers.model.quant_linear import Linear


class TensorParallel:
    """A rank's place in the model (`layout`) and its group."""

    def __init__(self, layout: ShardLayout, group: ParallelGroup) -> None:
        self.layout, self.group = layout, group

    def embed(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings of `ids` from every rank's vocabulary rows (`rows`: this rank's)."""
        local = ids - self.layout.vocab[0]
        outside = (local < 0) | (local >= rows.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), rows)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, vocab]: every rank's [B, vocab_per_rank] logits side by side."""
        parts = self.group.all_gather(logits)  # [size * B, per]
        b, n = logits.shape[0], self.group.size
        whole = parts.view(n, b, -1).transpose(0, 1).reshape(b, -1)
        return whole[:, : self.layout.cfg.vocab_size]


class ReducedLinear:
    """A row-parallel linear: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: Linear, group: ParallelGroup) -> None:
        if inner.bias is not None:
            raise ValueError("a row-parallel linear with a bias would add it once per rank")
        self.inner, self.group = inner, group

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))
