"""Hugging Face model directory loader: config.json + safetensors (or pytorch_model.bin)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from safetensors import safe_open

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.loader import (
    LoadedModel,
    check_weight_shapes,
    expected_weight_shapes,
    warn_unused,
)
from kvserve.workers.loading.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

logger = logging.getLogger(__name__)

_CAUSAL_LM_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# transformers' defaults for keys a config.json may omit
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}
_DEFAULT_SLIDING_WINDOW = {"llama": None, "mistral": 4096, "qwen2": 4096}
_WEIGHT_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


def load_hf_dir(path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    config_path = os.path.join(path, "config.json")
    raw = _read_json(config_path)
    config = config_from_hf(raw, config_path, _read_generation_config(path))

    expected = expected_weight_shapes(config)
    with ExitStack() as stack:
        sources = [stack.enter_context(_open_weights(f)) for f in _weight_files(path)]
        owner: dict[str, _WeightSource] = {}
        for source in sources:
            for key in source.keys():
                owner[key] = source
        where = sources[0].path if len(sources) == 1 else path
        found = {name: owner[name].shape(name) for name in expected if name in owner}
        check_weight_shapes(found, expected, where)
        warn_unused([k for k in owner if k not in expected and not _ignorable(k, config)], where)
        weights = {name: owner[name].get(name).to(dtype) for name in expected}
    return LoadedModel(config=config, weights=weights, path=path)


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
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {arch!r} (model_type); "
            f"kvserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    classes = raw.get("architectures") or []
    if classes and _CAUSAL_LM_CLASSES[arch] not in classes:
        raise ModelLoadError(
            f"{source}: unsupported model class {classes}; expected {_CAUSAL_LM_CLASSES[arch]}"
        )
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelLoadError(
            f"{source}: quantized checkpoints ({method}) are not supported; use an "
            "unquantized model directory or a GGUF file"
        )
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(f"{source}: unsupported activation {raw.get('hidden_act')!r}")
    if arch != "qwen2" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise ModelLoadError(f"{source}: attention/MLP biases are not supported for {arch}")

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
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: invalid head counts: {num_heads} query heads, {num_kv_heads} KV heads"
        )
    if raw.get("head_dim") is None and hidden % num_heads:
        raise ModelLoadError(f"{source}: hidden_size {hidden} is not a multiple of the heads")
    head_dim = get("head_dim", int, hidden // num_heads)

    rope_theta, rope_scaling = _rope(raw, source)
    max_positions = get("max_position_embeddings", int, _DEFAULT_MAX_POSITIONS[arch])
    window = _sliding_window(raw, arch)
    if window is not None and window < max_positions:
        # kvserve attends to the full context; capping the context at the window keeps
        # results identical to the reference sliding-window attention.
        logger.info("%s: sliding window %d: limiting the context to it", source, window)
        max_positions = window

    generation = generation or {}
    eos: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in eos:
                eos.append(token)
    bos = raw.get("bos_token_id", generation.get("bos_token_id"))

    return ModelConfig(
        architecture=arch,
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", int),
        num_layers=get("num_hidden_layers", int),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",  # Qwen2 always has q/k/v biases
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=eos,
        name=os.path.basename(os.path.normpath(os.path.dirname(source))),
    )


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, HF-style rope_scaling) from either config layout.

    transformers >= 5 writes "rope_parameters" holding rope_theta and the scaling
    keys together; older configs have top-level rope_theta and rope_scaling.
    """
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling: Any = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ModelLoadError(f"{source}: rope_theta must be a number, got {theta!r}")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object, got {scaling!r}")
    scaling = dict(scaling)
    # Old configs name the kind "type"; HF itself now reads "rope_type".
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if kind in (None, "default"):
        return float(theta), None
    return float(theta), {"rope_type": kind, **scaling}


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    window = raw.get("sliding_window", _DEFAULT_SLIDING_WINDOW[arch])
    if arch == "qwen2":
        # Qwen2 slides only when asked to, and then only on layers >= max_window_layers
        # (transformers 5 spells the outcome out in layer_types).
        layer_types = raw.get("layer_types")
        if isinstance(layer_types, list):
            slides = "sliding_attention" in layer_types
        else:
            first = raw.get("max_window_layers", 28)
            slides = bool(raw.get("use_sliding_window")) and first < raw.get("num_hidden_layers", 0)
        if not slides:
            return None
    return window if isinstance(window, int) and window > 0 else None


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

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError


class _SafetensorsSource(_WeightSource):
    def __init__(self, path: str, handle: Any) -> None:
        super().__init__(path)
        self._handle = handle

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(key)
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

    def get(self, key: str) -> torch.Tensor:
        return self._state[key]


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
