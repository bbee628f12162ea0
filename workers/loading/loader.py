"""Model weight loading: one entry point for GGUF files and Hugging Face directories.

Both loaders return weights under the architecture's Hugging Face names with HF shapes
(out_features, in_features), so the model code never sees the file format.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.loading.quant_format import QuantizedWeight
from kvserve.workers.loading.sharding import Shard

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
EXPECTED_INPUT = "a .gguf file or a Hugging Face model directory containing config.json"


class ModelWeights(Mapping[str, torch.Tensor]):
    """HF names -> tensors, some deferred: a GGUF float32 load keeps the quantized blocks of
    its 2-D weights (`LoadedModel.quantized`) and makes their float weights only when read
    (each read makes one). The int8 CPU kernel reads the blocks alone, so a model run that
    way never holds the float32 expansion (a 7-8B Q4_K_M file's would take ~30 GB)."""

    def __init__(self, tensors: dict[str, torch.Tensor],
                 deferred: dict[str, Callable[[], torch.Tensor]]) -> None:
        self._tensors, self._deferred = tensors, deferred

    def __getitem__(self, name: str) -> torch.Tensor:
        make = self._deferred.get(name)
        return make() if make is not None else self._tensors[name]

    def __contains__(self, name: object) -> bool:  # Mapping's would make the tensor
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def held(self, name: str) -> torch.Tensor:
        """The tensor as held: a deferred one is a meta tensor of its shape and dtype."""
        return self._tensors[name]


def held_weight(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """`weights[name]` without making a deferred one (a meta tensor in its place)."""
    return weights.held(name) if isinstance(weights, ModelWeights) else weights[name]


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF names -> tensors in the requested dtype; "lm_head.weight" absent when tied
    weights: Mapping[str, torch.Tensor]
    path: str
    # Raw ggml blocks of 2-D weights in a type the CPU kernel reads (GGUF float32
    # loads only), by the same HF names and row order as `weights`.
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    # a tensor-parallel rank's load: `weights` hold only its part of each tensor
    shard: Shard | None = None


def load_model(path: str, dtype: torch.dtype = torch.float32,
               shard: Shard | None = None) -> LoadedModel:
    """Load a GGUF file or an HF model directory; every failure is a ModelLoadError.
    With `shard`, only that tensor-parallel rank's part of each weight is read
    (`sharding.py`); a model the ranks cannot split is a ModelLoadError naming the numbers."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
    path = os.path.expanduser(os.fspath(path))
    if _kind(path) == "hf":
        from kvserve.workers.loading.hf_loader import load_hf_dir

        return load_hf_dir(path, dtype, shard)
    from kvserve.workers.loading.gguf_loader import load_gguf

    return load_gguf(path, dtype, shard)


def read_model_config(path: str) -> ModelConfig:
    """The configuration of a GGUF file or HF directory, without reading its weights."""
    path = os.path.expanduser(os.fspath(path))
    if _kind(path) == "hf":
        from kvserve.workers.loading.hf_loader import read_hf_config

        return read_hf_config(path)
    from kvserve.workers.loading.gguf_loader import read_gguf_config

    return read_gguf_config(path)


def _kind(path: str) -> str:
    """"hf" or "gguf"; ModelLoadError for anything else."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{path}: directory has no config.json; expected {EXPECTED_INPUT}")
        return "hf"
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory; expected {EXPECTED_INPUT}")
    if path.lower().endswith(".gguf") or _has_gguf_magic(path):
        return "gguf"
    raise ModelLoadError(
        f"{path}: not a GGUF file (no .gguf suffix, no GGUF magic bytes); expected {EXPECTED_INPUT}"
    )


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read file: {e}") from e


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by its HF name for the architecture, with its HF
    (out, in) shape."""
    h = config.hidden_size
    d = config.head_dim
    q_out = config.num_heads * d
    kv_out = config.num_kv_heads * d
    ffn = config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    fused = config.architecture == "phi3"  # Phi-3 stores q/k/v and gate/up fused
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        if fused:
            shapes[p + "self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if config.is_moe_layer(i):
            shapes.update(moe_weight_shapes(config, i))
        else:
            if fused:
                shapes[p + "mlp.gate_up_proj.weight"] = (2 * ffn, h)
            else:
                shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
                shapes[p + "mlp.up_proj.weight"] = (ffn, h)
            shapes[p + "mlp.down_proj.weight"] = (h, ffn)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    return shapes


def moe_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """An MoE layer's router and stacked experts, under the names both loaders return
    (Qwen3-MoE's and Mixtral's alike; HF files hold the experts one by one, GGUF stacked)."""
    p = f"model.layers.{layer}.mlp."
    e, h, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    return {
        p + "gate.weight": (e, h),
        p + "experts.gate_proj.weight": (e, f, h),
        p + "experts.up_proj.weight": (e, f, h),
        p + "experts.down_proj.weight": (e, h, f),
    }


def check_weight_shapes(
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    source: str,
    names: Mapping[str, str] | None = None,
) -> None:
    """Raise ModelLoadError for missing tensors or wrong shapes, before any data is read.

    `names` maps HF names to the names used in the file, so messages quote what the
    user can find in the file (e.g. GGUF "blk.3.attn_q.weight").
    """

    def shown(hf_name: str) -> str:
        return names.get(hf_name, hf_name) if names else hf_name

    missing = [shown(n) for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"{source}: missing tensors {', '.join(missing[:5])}{more}; "
            "the file does not match its own configuration or is incomplete"
        )
    for name, shape in expected.items():
        got = tuple(found[name])
        if got != tuple(shape):
            raise ModelLoadError(
                f"{source}: tensor {shown(name)} has shape {list(got)} but the configuration "
                f"implies {list(shape)}"
            )


def warn_unused(names: list[str], source: str) -> None:
    """Tensors in the file that the model does not use: harmless, but worth a log line."""
    if names:
        more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
        logger.warning("%s: ignoring unused tensors %s%s", source, ", ".join(names[:5]), more)
