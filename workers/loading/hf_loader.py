"""Hugging Face model directory loader: config.json + safetensors (or pytorch_model.bin)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from safetensors import safe_open

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.hf_moe import expert_views, moe_fields
from kvserve.workers.loading.loader import (
    LoadedModel,
    check_weight_shapes,
    expected_weight_shapes,
    warn_unused,
)
from kvserve.workers.loading.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvserve.workers.loading.sharding import Shard, ShardLayout, Split, take
from kvserve.workers.loading.sharding import index as dim_slice

# HF model_type -> (ModelConfig.architecture, the causal-LM class its config names)
_HF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
}
# transformers' defaults for keys a config.json may omit
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768,
                          "gemma2": 8192, "gemma3": 131072, "phi3": 4096, "qwen3_moe": 32768,
                          "mixtral": 131072}
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "gemma2": 4096,
                           "gemma3": 4096, "qwen3_moe": 4096}
# Gemma: every n-th layer attends globally, the others through the sliding window
_DEFAULT_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_WEIGHT_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


def load_hf_dir(path: str, dtype: torch.dtype = torch.float32,
                shard: Shard | None = None) -> LoadedModel:
    """The model's weights, or with `shard` only that rank's part of each (safetensors
    slices: the whole model is never in memory)."""
    config = read_hf_config(path)
    layout = ShardLayout(config, shard, path) if shard is not None else None

    expected = expected_weight_shapes(config)
    with ExitStack() as stack:
        sources = [stack.enter_context(_open_weights(f)) for f in _weight_files(path)]
        owner: dict[str, _WeightSource] = {}
        for source in sources:
            for key in source.keys():
                owner[key] = source
        where = sources[0].path if len(sources) == 1 else path
        found = {name: owner[name].shape(name) for name in expected if name in owner}
        # MoE experts stacked from per-expert (or transformers' fused) tensors
        views = expert_views(config, set(owner), lambda k: owner[k].shape(k), where)
        found.update({name: v.shape for name, v in views.items() if name not in found})
        check_weight_shapes(found, expected, where)
        used = set(expected) | {k for v in views.values() for k in v.keys}
        warn_unused([k for k in owner if k not in used and not _ignorable(k, config)], where)

        def read(name: str) -> torch.Tensor:
            split = layout.split(name) if layout is not None else None
            if name in owner:
                return owner[name].get(name, split)
            view = views[name]
            if split is not None and view.per_expert:  # each expert's part, then stacked
                return view.load(lambda k: owner[k].get(k, split.inner()))
            return take(view.load(lambda k: owner[k].get(k)), split)

        weights = {name: read(name).to(dtype) for name in expected}
    return LoadedModel(config=config, weights=weights, path=path, shard=shard)


def read_hf_config(path: str) -> ModelConfig:
    """The model's configuration alone (config.json, generation_config.json)."""
    config_path = os.path.join(path, "config.json")
    return config_from_hf(_read_json(config_path), config_path, _read_generation_config(path))


def _ignorable(key: str, config: ModelConfig) -> bool:
    # Old checkpoints saved the RoPE buffer; tied checkpoints may still carry lm_head.
    return key.endswith("rotary_emb.inv_freq") or (
        key == "lm_head.weight" and config.tie_word_embeddings
    )


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: file not found") from e
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read file: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from e


def _read_generation_config(path: str) -> dict[str, Any]:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return {}
    gen = _read_json(gen_path)
    return gen if isinstance(gen, dict) else {}


def config_from_hf(raw: Any, source: str, generation: dict[str, Any] | None = None) -> ModelConfig:
    """ModelConfig from a parsed config.json (old and transformers-5 layouts)."""
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in _HF_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {model_type!r} (model_type); "
            f"kvserve supports {', '.join(_HF_ARCHITECTURES)}"
        )
    arch, causal_lm = _HF_ARCHITECTURES[model_type]
    classes = raw.get("architectures") or []
    if classes and causal_lm not in classes:
        raise ModelLoadError(f"{source}: unsupported model class {classes}; expected {causal_lm}")
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelLoadError(
            f"{source}: quantized checkpoints ({method}) are not supported; use an "
            "unquantized model directory or a GGUF file"
        )
    gemma = arch in ("gemma2", "gemma3")
    act_key = "hidden_activation" if gemma and raw.get("hidden_activation") else "hidden_act"
    act = _ACTIVATIONS.get(raw.get(act_key, "gelu_pytorch_tanh" if gemma else "silu"))
    if act is None or (gemma and act != "gelu_tanh") or (not gemma and act != "silu"):
        raise ModelLoadError(f"{source}: unsupported activation {raw.get(act_key)!r} for {arch}")
    if arch != "qwen2" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise ModelLoadError(f"{source}: attention/MLP biases are not supported for {arch}")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: bidirectional attention (an embedding model) is not supported")

    def get(key: str, kind: type, default: Any = None) -> Any:
        value = raw.get(key)
        if value is None:
            if default is None:
                raise ModelLoadError(f"{source}: missing required key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"{source}: key {key!r} must be a number, got {value!r}")
        if kind is int and value != int(value):
            raise ModelLoadError(f"{source}: key {key!r} must be an integer, got {value!r}")
        return kind(value)

    hidden = get("hidden_size", int)
    num_heads = get("num_attention_heads", int)
    num_kv_heads = get("num_key_value_heads", int, num_heads)
    num_layers = get("num_hidden_layers", int)
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: invalid head counts: {num_heads} query heads, {num_kv_heads} KV heads"
        )
    if raw.get("head_dim") is None and hidden % num_heads:
        raise ModelLoadError(f"{source}: hidden_size {hidden} is not a multiple of the heads")
    head_dim = get("head_dim", int, hidden // num_heads)

    rope = _rope(raw, source)
    max_positions = get("max_position_embeddings", int, _DEFAULT_MAX_POSITIONS[arch])
    rotary_dim = None
    if rope.partial_factor != 1.0:
        rotary_dim = int(head_dim * rope.partial_factor)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ModelLoadError(f"{source}: partial_rotary_factor {rope.partial_factor} gives "
                                 f"{rotary_dim} rotary dims of {head_dim}")
    if rope.scaling is not None and rope.scaling["rope_type"] == "longrope":
        # The pre-training context is the default one, as in vLLM: a longer max_model_len
        # switches every position to the long factors (see layers/rope.py).
        original = rope.scaling.get("original_max_position_embeddings",
                                    raw.get("original_max_position_embeddings"))
        if not isinstance(original, int) or original <= 0:
            raise ModelLoadError(f"{source}: longrope needs original_max_position_embeddings")
        rope.scaling["original_max_position_embeddings"] = original
        rope.scaling.setdefault("max_position_embeddings", max_positions)
        max_positions = min(max_positions, original)
    window, layer_types = _sliding_window(raw, arch, num_layers, source)

    generation = generation or {}
    eos: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in eos:
                eos.append(token)
    bos = raw.get("bos_token_id", generation.get("bos_token_id"))

    def optional(key: str) -> float | None:
        return None if raw.get(key) is None else get(key, float)

    return ModelConfig(
        architecture=arch,
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", int),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_position_embeddings=max_positions,
        # Gemma ties its embeddings unless told otherwise (transformers' default)
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        attention_bias=arch == "qwen2",  # Qwen2 always has q/k/v biases
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=eos,
        name=os.path.basename(os.path.normpath(os.path.dirname(source))),
        hidden_act=act,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe"),
        rotary_dim=rotary_dim,
        embed_scale=hidden**0.5 if gemma else None,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        query_pre_attn_scalar=get("query_pre_attn_scalar", float, 256.0) if gemma else None,
        # Gemma 3's attention ignores attn_logit_softcapping, as transformers' does
        attn_logit_softcapping=optional("attn_logit_softcapping") if arch == "gemma2" else None,
        final_logit_softcapping=optional("final_logit_softcapping") if gemma else None,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=rope.local_theta,
        **moe_fields(raw, arch, num_layers, source),
    )


class _Rope:
    def __init__(self, theta: float, scaling: dict[str, Any] | None, partial_factor: float,
                 local_theta: float | None) -> None:
        self.theta = theta
        self.scaling = scaling
        self.partial_factor = partial_factor
        self.local_theta = local_theta  # Gemma 3's sliding layers


def _rope(raw: dict[str, Any], source: str) -> _Rope:
    """RoPE settings from either config layout.

    transformers >= 5 writes "rope_parameters" holding rope_theta and the scaling
    keys together (Gemma 3: one such dict per layer type); older configs have top-level
    rope_theta, rope_scaling, partial_rotary_factor and rope_local_base_freq.
    """
    params = raw.get("rope_parameters")
    local_theta = raw.get("rope_local_base_freq")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention") or {}
        local_kind = local.get("rope_type", local.get("type", "default"))
        if local_kind != "default":
            raise ModelLoadError(f"{source}: rope scaling {local_kind!r} on sliding layers is not supported")
        local_theta = local.get("rope_theta", local_theta)
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling: Any = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    for key, value in (("rope_theta", theta), ("rope_local_base_freq", local_theta)):
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ModelLoadError(f"{source}: {key} must be a number, got {value!r}")
    partial = raw.get("partial_rotary_factor", 1.0)
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object, got {scaling!r}")
    scaling = dict(scaling or {})
    partial = scaling.pop("partial_rotary_factor", partial)
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise ModelLoadError(f"{source}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    # Old configs name the kind "type"; HF itself now reads "rope_type".
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if kind in ("su", "yarn") and raw.get("model_type") == "phi3":
        kind = "longrope"  # Phi-3's old names for it, as transformers reads them
    local = None if local_theta is None else float(local_theta)
    if kind in (None, "default"):
        return _Rope(float(theta), None, float(partial), local)
    return _Rope(float(theta), {"rope_type": kind, **scaling}, float(partial), local)


def _sliding_window(raw: dict[str, Any], arch: str, num_layers: int,
                    source: str) -> tuple[int | None, list[str] | None]:
    """(window, per-layer types) as transformers builds them for `arch`; (None, None) when
    no layer slides."""
    window = raw.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(arch))
    if arch == "llama" or not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None, None
    types = raw.get("layer_types")
    if isinstance(types, list):
        if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
            raise ModelLoadError(f"{source}: layer_types {types!r} do not fit {num_layers} layers")
    elif arch == "qwen3_moe":  # every layer, when asked to
        types = [SLIDING_ATTENTION if raw.get("use_sliding_window") else FULL_ATTENTION] * num_layers
    elif arch in ("qwen2", "qwen3"):
        # Qwen slides only when asked to, and then only on layers >= max_window_layers
        first = raw.get("max_window_layers", 28)
        slides = bool(raw.get("use_sliding_window"))
        types = [SLIDING_ATTENTION if slides and i >= first else FULL_ATTENTION for i in range(num_layers)]
    elif arch in _DEFAULT_GLOBAL_EVERY:
        every = raw.get("sliding_window_pattern", _DEFAULT_GLOBAL_EVERY[arch])
        types = [FULL_ATTENTION if (i + 1) % every == 0 else SLIDING_ATTENTION for i in range(num_layers)]
    else:  # Mistral, Phi-3: every layer
        types = [SLIDING_ATTENTION] * num_layers
    if SLIDING_ATTENTION not in types:
        return None, None
    return window, list(types)


def _weight_files(path: str) -> list[str]:
    for name in _WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if not name.endswith(".index.json"):
            return [file]
        index = _read_json(file)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{file}: no weight_map in the shard index")
        shards = [os.path.join(path, s) for s in sorted(set(map(str, weight_map.values())))]
        for shard in shards:
            if not os.path.isfile(shard):
                raise ModelLoadError(f"{shard}: shard listed in {name} is missing")
        return shards
    raise ModelLoadError(f"{path}: no weights found; expected one of {', '.join(_WEIGHT_FILES)}")


class _WeightSource:
    """Uniform view of one weight file: tensor names, shapes and data."""

    def __init__(self, path: str) -> None:
        self.path = path

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def get(self, key: str, split: Split | None = None) -> torch.Tensor:
        """The tensor, or its part under `split`."""
        raise NotImplementedError


class _SafetensorsSource(_WeightSource):
    def __init__(self, path: str, handle: Any) -> None:
        super().__init__(path)
        self._handle = handle

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(key).get_shape())

    def get(self, key: str, split: Split | None = None) -> torch.Tensor:
        try:
            if split is None:
                return self._handle.get_tensor(key)
            part = self._handle.get_slice(key)
            n = len(part.get_shape())
            pieces = [part[dim_slice(n, split.dim, a, b)] for a, b in split.ranges]
            return torch.cat(pieces, dim=split.dim) if len(pieces) > 1 else pieces[0]
        except Exception as e:
            raise ModelLoadError(f"{self.path}: cannot read tensor {key}: {e}") from e


class _StateDictSource(_WeightSource):
    def __init__(self, path: str, state: dict[str, torch.Tensor]) -> None:
        super().__init__(path)
        self._state = state

    def keys(self) -> list[str]:
        return list(self._state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._state[key].shape)

    def get(self, key: str, split: Split | None = None) -> torch.Tensor:
        return take(self._state[key], split)


@contextmanager
def _open_weights(path: str) -> Iterator[_WeightSource]:
    """Open a .safetensors (memory-mapped) or .bin weight file as a _WeightSource."""
    if not path.endswith(".safetensors"):
        yield _StateDictSource(path, _torch_load(path))
        return
    try:
        handle = safe_open(path, framework="pt")
    except Exception as e:  # SafetensorError, OSError, ...: all mean an unusable file
        raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {e}") from e
    with handle:
        yield _SafetensorsSource(path, handle)


def _torch_load(path: str) -> dict[str, torch.Tensor]:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            # mmap needs the zip format; legacy pickles load without it.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: corrupt or unreadable PyTorch checkpoint: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{path}: expected a state dict of tensors")
    return state
