"""Tensor-parallel shards of a model: which rows or columns of each weight a rank holds.

Megatron's split: attention heads and KV heads go to ranks in order (q/k/v rows, o
columns); a model with fewer KV heads than ranks gives each KV head to size / heads ranks
in a row (replicated), so a rank's query heads always share its one KV head. The MLP's
gate/up rows and down columns split the intermediate width (an MoE model splits every
expert the same way); embeddings and the LM head split the vocabulary by rows. Norms, the
MoE router and everything else stay whole on every rank. The loaders read only a rank's
part of each tensor (`ShardLayout.split`), so no rank holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.model_config import ModelConfig

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Shard:
    """One rank of a tensor-parallel group of `size` ranks."""

    rank: int
    size: int


@dataclass(frozen=True)
class Split:
    """A rank's part of a tensor: the slices `ranges` of dimension `dim`, concatenated."""

    dim: int
    ranges: Ranges

    def inner(self) -> Split:
        """The same split of one expert of a stacked [E, ...] tensor."""
        return Split(self.dim - 1, self.ranges)

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.ranges)


def take(x: torch.Tensor, split: Split | None) -> torch.Tensor:
    """`x`'s part under `split` (a copy, so the whole tensor can be freed)."""
    if split is None:
        return x
    parts = [x.narrow(split.dim, a, b - a) for a, b in split.ranges]
    return torch.cat(parts, dim=split.dim) if len(parts) > 1 else parts[0].clone()


def index(ndim: int, dim: int, a: int, b: int) -> tuple[slice, ...]:
    """The basic index of the slice a:b of dimension `dim` (for memory maps and safetensors)."""
    return tuple(slice(a, b) if d == dim else slice(None) for d in range(ndim))


def kv_head_ranks(num_kv_heads: int, size: int) -> list[int]:
    """For each KV head, the first rank that holds it (replicas of a head are skipped when a
    snapshot gathers whole heads)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return [h // per for h in range(num_kv_heads)]
    return [h * (size // num_kv_heads) for h in range(num_kv_heads)]


def check_tensor_parallel(cfg: ModelConfig, size: int, source: str) -> None:
    """ModelLoadError naming the numbers when `size` ranks cannot split the model."""
    if size < 1:
        raise ModelLoadError(f"{source}: tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if hq % size:
        raise ModelLoadError(f"{source}: tensor_parallel_size {size} does not divide the model's "
                             f"{hq} attention heads")
    if hkv % size and not (hkv < size and size % hkv == 0):
        raise ModelLoadError(
            f"{source}: tensor_parallel_size {size} must divide the model's {hkv} KV heads, or "
            f"be a multiple of them (each KV head then replicated on {size} / {hkv} ranks)")
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if dense and cfg.intermediate_size % size:
        raise ModelLoadError(f"{source}: tensor_parallel_size {size} does not divide the MLP's "
                             f"intermediate size {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % size:
        raise ModelLoadError(f"{source}: tensor_parallel_size {size} does not divide the experts' "
                             f"intermediate size {cfg.moe_intermediate_size}")


class ShardLayout:
    """Where a rank's heads, MLP width and vocabulary rows lie in the whole model."""

    def __init__(self, cfg: ModelConfig, shard: Shard, source: str = "") -> None:
        check_tensor_parallel(cfg, shard.size, source or cfg.name or "model")
        n, r = shard.size, shard.rank
        self.cfg, self.shard = cfg, shard
        d = cfg.head_dim
        hq = cfg.num_heads // n
        self.num_heads = hq
        if cfg.num_kv_heads >= n:
            self.num_kv_heads = cfg.num_kv_heads // n
            first_kv = r * self.num_kv_heads
        else:  # replicated: ranks r*k .. r*k + k - 1 share KV head r // k
            self.num_kv_heads = 1
            first_kv = r // (n // cfg.num_kv_heads)
        self.q_rows = (r * hq * d, (r + 1) * hq * d)
        self.kv_rows = (first_kv * d, (first_kv + self.num_kv_heads) * d)
        self.kv_heads = (first_kv, first_kv + self.num_kv_heads)
        self.ffn = _part(cfg.intermediate_size, shard)
        self.expert_ffn = _part(cfg.moe_intermediate_size, shard)
        self.vocab_per_rank = -(-cfg.vocab_size // n)
        v0 = min(cfg.vocab_size, r * self.vocab_per_rank)
        self.vocab = (v0, min(cfg.vocab_size, v0 + self.vocab_per_rank))

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def split(self, name: str) -> Split | None:
        """This rank's part of the tensor `name` (HF naming); None: the whole tensor."""
        cfg = self.cfg
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Split(0, (self.vocab,))
        if ".self_attn." in name:
            kind = name.rsplit(".", 2)[-2]
            if kind == "q_proj":
                return Split(0, (self.q_rows,))
            if kind in ("k_proj", "v_proj"):
                return Split(0, (self.kv_rows,))
            if kind == "o_proj":
                return Split(1, (self.q_rows,))
            if kind == "qkv_proj":  # Phi-3: [q | k | v] rows
                q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
                return Split(0, (self.q_rows, _shift(self.kv_rows, q), _shift(self.kv_rows, q + kv)))
            return None  # q_norm / k_norm: per head, whole
        if ".mlp.experts." in name:
            f = self.expert_ffn
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                return Split(1, (f,))
            if name.endswith("down_proj.weight"):
                return Split(2, (f,))
            return None
        if ".mlp." in name:
            f = self.ffn
            if name.endswith((".gate_proj.weight", ".up_proj.weight")):
                return Split(0, (f,))
            if name.endswith(".gate_up_proj.weight"):  # Phi-3: [gate | up] rows
                return Split(0, (f, _shift(f, cfg.intermediate_size)))
            if name.endswith(".down_proj.weight"):
                return Split(1, (f,))
        return None

    def row_parallel(self, name: str) -> bool:
        """The tensor is split by input columns: its matmul gives partial sums that the ranks
        add up (all-reduce)."""
        if ".experts." in name:  # an MoE block adds its experts' sums once (layers/moe.py)
            return False
        split = self.split(name)
        return split is not None and split.dim == 1

    def vocab_parallel(self, name: str) -> bool:
        return name in ("model.embed_tokens.weight", "lm_head.weight")


def _part(width: int, shard: Shard) -> tuple[int, int]:
    per = width // shard.size
    return shard.rank * per, (shard.rank + 1) * per


def _shift(r: tuple[int, int], by: int) -> tuple[int, int]:
    return r[0] + by, r[1] + by
