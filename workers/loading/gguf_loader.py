"""GGUF (llama.cpp) loader: metadata -> ModelConfig, tensors -> dequantized HF-named weights."""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.gguf_moe import expert_rows, moe_architecture, moe_fields
from kvserve.workers.loading.loader import (
    LoadedModel,
    ModelWeights,
    check_weight_shapes,
    expected_weight_shapes,
    warn_unused,
)
from kvserve.workers.loading.model_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
)
from kvserve.workers.loading.quant_format import QTYPES, REWRITTEN, QuantizedWeight, as_kernel_type
from kvserve.workers.loading.sharding import Shard, ShardLayout, Split, index

# GGUF general.architecture -> ModelConfig.architecture. llama.cpp writes most Mistral
# models as "llama"; both use the same (permuted) Q/K layout.
_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
                  "qwen3moe": "qwen3_moe"}  # Mixtral: "llama" with experts (gguf_moe.py)
# llama.cpp's converter interleaves the rotary halves of Q and K for these (the archs whose
# llama.cpp RoPE is the "normal", pairwise one); the NEOX-RoPE archs keep HF's order.
_PERMUTED_QK = {"llama", "mistral"}
_GEMMA = {"gemma2", "gemma3"}
# Gemma: every n-th layer attends globally (llama.cpp's fixed patterns for these archs)
_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 LongRoPE
_ROPE_FREQS = "rope_freqs.weight"
# looked up by rows, so always made in float
_EMBEDDING = "model.embed_tokens.weight"
_INTEGER_TYPES = {
    GGMLQuantizationType.I8,
    GGMLQuantizationType.I16,
    GGMLQuantizationType.I32,
    GGMLQuantizationType.I64,
}


class _CheckedReader(GGUFReader):
    """GGUFReader that reports truncated tensor data by name.

    Stock GGUFReader slices the memory map without bounds checks, so a truncated
    file fails later with an opaque numpy reshape error (or, for zero-sized
    slices, not at all).
    """

    def __init__(self, path: str) -> None:
        self._display_path = path
        super().__init__(path)

    # GGUFReader slices `data` once per metadata item (~250k times for a 49k-token
    # vocabulary); slices of an np.memmap run a costly __array_finalize__ each time,
    # slices of a plain ndarray view of the same mapping do not (~3x faster to open).
    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        # GGUFReader slices the map once per array element: seconds for a vocabulary (token
        # types, ~50k strings and as many merges). A scalar array becomes one part (its
        # contents() are the same list); a long string array (vocabulary, merges), which the
        # loader never reads beyond its length, is stepped over with struct and kept as one
        # opaque byte part (its contents() are empty).
        arr = gguf.GGUFValueType.ARRAY
        if raw_type != arr or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        n = int(count[0])
        item_type = gguf.GGUFValueType(int(item[0]))
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            values = self._get(orig_offs + 12, scalar, n)
            return 12 + int(values.nbytes), [item, count, values], [2], [arr, item_type]
        if item_type != gguf.GGUFValueType.STRING or n < 1024:  # short lists: read as usual
            return super()._get_field_parts(orig_offs, raw_type)
        buf, at = self._mapped, orig_offs + 12
        for _ in range(n):
            at += 8 + struct.unpack_from("<Q", buf, at)[0]
        blob = self._get(orig_offs + 12, np.uint8, at - orig_offs - 12)
        return at - orig_offs, [item, count, blob], [], [arr, item_type]

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        file_size = len(self.data)
        for field in fields:
            # Tensor-info layout: name length, name, n_dims, dims, type, data offset.
            if len(field.parts) != 6:  # a gguf release with another layout: skip the check
                break
            _, name_data, _, dims, raw_type, rel_offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError as e:
                raise ModelLoadError(
                    f"{self._display_path}: tensor {name} has unknown GGML type id "
                    f"{int(raw_type[0])}; the file is corrupt or newer than the gguf package"
                ) from e
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elements = math.prod(int(d) for d in dims)
            end = int(start_offs) + int(rel_offset[0]) + n_elements // block_size * type_size
            if end > file_size:
                raise ModelLoadError(
                    f"{self._display_path}: truncated: tensor {name} needs bytes up to {end} "
                    f"but the file has {file_size}"
                )
        super()._build_tensors(start_offs, fields)


def load_gguf(path: str, dtype: torch.dtype = torch.float32, shard: Shard | None = None) -> LoadedModel:
    """The model's weights, or with `shard` only that rank's part of each (read from the
    memory map slice by slice: the whole model is never in memory)."""
    reader = _open(path)
    arch, tensors, config = _read_config(reader, path)
    layout = ShardLayout(config, shard, path) if shard is not None else None

    expected = expected_weight_shapes(config)
    hf_to_gguf = _hf_to_gguf_names(expected, arch, config.num_layers)
    found = {hf: _torch_shape(tensors[g]) for hf, g in hf_to_gguf.items() if g in tensors}
    check_weight_shapes(found, expected, path, names=hf_to_gguf)
    used = set(hf_to_gguf.values()) | {_ROPE_FREQS, *_ROPE_FACTORS}
    warn_unused([n for n in tensors if n not in used], path)

    permute = arch in _PERMUTED_QK
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    lazy: dict[str, Callable[[], torch.Tensor]] = {}
    # Tensor by tensor from the memory map: at most one float32 intermediate is alive
    # beside the converted result.
    for hf_name in expected:
        tensor = tensors[hf_to_gguf[hf_name]]
        split = layout.split(hf_name) if layout is not None else None
        n_heads = 0
        if permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            n_heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
            if layout is not None:  # whole heads: the permutation stays inside each
                n_heads = layout.num_heads if "q_proj" in hf_name else layout.num_kv_heads
        # A linear whose blocks the kernel reads gets its float weight only when a reader
        # asks (Weights.get): the int8 step never does, and a 7-8B Q4_K_M file's float32
        # expansion (~30 GB) would not fit beside it.
        deferred = layout is None and len(tensor.shape) == 2 and hf_name != _EMBEDDING
        # only float32 runs (the CPU) use the raw-block kernel: keep the blocks for them
        array, raw = _read_tensor(tensor, path, split, keep_raw=dtype == torch.float32,
                                  need_float=not deferred)
        if array is None:
            weights[hf_name] = torch.empty(_torch_shape(tensor), dtype=dtype, device="meta")
            lazy[hf_name] = functools.partial(_float_weight, tensor, path, n_heads, dtype)
        else:
            if n_heads:
                array = _unpermute_qk(array, n_heads)
            if arch in _GEMMA and hf_name.endswith("norm.weight"):
                array = array - 1.0  # llama.cpp stores Gemma's norms as 1 + w: back to HF's w
            weights[hf_name] = torch.from_numpy(array).to(dtype)
        qtype = tensor.tensor_type.name
        if raw is None:
            continue
        raw, qtype = as_kernel_type(raw, qtype)
        shape = tuple(weights[hf_name].shape)
        if len(shape) == 3:  # MoE experts
            quantized.update(expert_rows(hf_name, torch.from_numpy(raw), qtype, shape))
        elif len(shape) == 2:
            if n_heads:  # rows are independent, so the same row permutation applies
                raw = np.ascontiguousarray(_unpermute_qk(raw, n_heads))
            quantized[hf_name] = QuantizedWeight(qtype, torch.from_numpy(raw), shape)
    return LoadedModel(config=config, weights=ModelWeights(weights, lazy), path=path, quantized=quantized,
                       shard=shard)


def read_gguf_config(path: str) -> ModelConfig:
    """The model's configuration alone (its metadata; no tensor is read)."""
    return _read_config(_open(path), path)[2]


def _read_config(reader: GGUFReader, path: str) -> tuple[str, dict[str, Any], ModelConfig]:
    arch = _field(reader, path, "general.architecture", str)
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r} (general.architecture); "
            f"kvserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    return arch, tensors, _config_from_metadata(reader, path, arch, tensors)


def _read_tensor(tensor: Any, path: str, split: Split | None, keep_raw: bool,
                 need_float: bool = True) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(float32 array in torch shape, its raw ggml rows or None) of the tensor's part under
    `split`. Quantized rows split freely; a split of the input dimension keeps the raw rows
    only where it falls on block boundaries (the CPU kernel reads whole blocks), and
    otherwise dequantizes the covering blocks and cuts them (the weight then runs in fp32).
    Without `need_float` a whole tensor whose raw rows are kept comes without its array."""
    shape = _torch_shape(tensor)
    data = tensor.data
    qtype = tensor.tensor_type
    keep_raw = keep_raw and (qtype.name in QTYPES or qtype.name in REWRITTEN)
    if split is None:
        raw = np.array(data, dtype=np.uint8) if keep_raw else None  # a copy: [rows, row bytes]
        return (_dequantize(tensor, path) if need_float or raw is None else None), raw
    ndim = len(shape)
    if tuple(data.shape) == shape:  # one element per weight (F32, F16, ...): plain slices
        parts = [np.asarray(data[index(ndim, split.dim, a, b)]) for a, b in split.ranges]
        return _dequantize(tensor, path, np.concatenate(parts, axis=split.dim)), None
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if split.dim < ndim - 1:  # whole rows of blocks
        raw = np.concatenate([np.asarray(data[index(ndim, split.dim, a, b)])
                              for a, b in split.ranges], axis=split.dim)
        return _dequantize(tensor, path, raw), (raw if keep_raw else None)
    arrays, raws = [], []
    aligned = all(a % block == 0 and b % block == 0 for a, b in split.ranges)
    for a, b in split.ranges:
        lo, hi = a // block, -(-b // block)  # the blocks covering columns a:b
        part = np.ascontiguousarray(data[..., lo * size : hi * size])
        arrays.append(_dequantize(tensor, path, part)[..., a - lo * block : b - lo * block])
        raws.append(part)
    raw = np.concatenate(raws, axis=-1) if aligned and keep_raw else None
    return np.ascontiguousarray(np.concatenate(arrays, axis=-1)), raw


def _open(path: str) -> GGUFReader:
    try:
        return _CheckedReader(path)
    except ModelLoadError:
        raise
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read file: {e}") from e
    except Exception as e:
        # GGUFReader reports malformed headers with assorted exception types
        # (ValueError, IndexError, KeyError, UnicodeDecodeError, ...).
        raise ModelLoadError(
            f"{path}: not a valid GGUF file (corrupt or truncated header: {type(e).__name__}: {e})"
        ) from e


_MISSING: Any = object()


def _field(reader: GGUFReader, path: str, key: str, kind: type, default: Any = _MISSING) -> Any:
    """A metadata value converted to `kind`; list values are returned as lists of `kind`."""
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"{path}: missing required metadata key {key}")
        return default
    try:
        value = field.contents()
        if isinstance(value, list):
            return [kind(v) for v in value]
        if kind in (int, float) and isinstance(value, (str, bytes)):
            raise TypeError(f"expected a number, got {value!r}")
        return kind(value)
    except (TypeError, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: metadata key {key} has an invalid value: {e}") from e


def _uniform(value: Any, path: str, key: str) -> Any:
    # Some GGUFs store per-layer arrays (e.g. head_count_kv); kvserve needs one value.
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ModelLoadError(f"{path}: per-layer values for {key} are not supported")
        return value[0]
    return value


def _config_from_metadata(
    reader: GGUFReader, path: str, arch: str, tensors: dict[str, Any]
) -> ModelConfig:
    def meta(suffix: str, kind: type, default: Any = _MISSING) -> Any:
        key = f"{arch}.{suffix}"
        return _uniform(_field(reader, path, key, kind, default), path, key)

    hidden = meta("embedding_length", int)
    num_heads = meta("attention.head_count", int)
    num_kv_heads = meta("attention.head_count_kv", int, num_heads)
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{path}: invalid head counts: {num_heads} query heads, {num_kv_heads} KV heads"
        )
    default_head_dim = hidden // num_heads if hidden % num_heads == 0 else _MISSING
    head_dim = meta("attention.key_length", int, default_head_dim)
    value_dim = meta("attention.value_length", int, head_dim)
    rope_dim = meta("rope.dimension_count", int, head_dim)
    # partial rotation (the leading rope_dim dims) only where llama.cpp's RoPE is NEOX's
    partial_ok = arch not in _PERMUTED_QK and 0 < rope_dim < head_dim
    if value_dim != head_dim or (rope_dim != head_dim and not partial_ok) or rope_dim % 2:
        raise ModelLoadError(
            f"{path}: unsupported attention layout (key length {head_dim}, value length "
            f"{value_dim}, rotary dimensions {rope_dim}); kvserve needs them equal and even"
        )

    vocab_size = meta("vocab_size", int, None)
    if vocab_size is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        if tokens is not None:  # read as [key parts..., item type, count, bytes]
            vocab_size = int(tokens.parts[-2][0])
        elif "token_embd.weight" in tensors:
            vocab_size = _torch_shape(tensors["token_embd.weight"])[0]
        else:
            raise ModelLoadError(f"{path}: cannot determine the vocabulary size")

    context_length = meta("context_length", int, 2048)
    rope_theta = meta("rope.freq_base", float, 10000.0)
    rope_scaling = _rope_scaling(reader, path, arch, tensors, rope_dim, rope_theta)
    if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
        # the pre-training context is the default one (see hf_loader and layers/rope.py)
        rope_scaling["max_position_embeddings"] = context_length
        context_length = min(context_length, rope_scaling["original_max_position_embeddings"])
    num_layers = meta("block_count", int)
    window, layer_types = _sliding_window(reader, path, arch, num_layers)
    gemma = arch in _GEMMA
    scale = meta("attention.scale", float, None)
    if scale is not None:
        pre_attn_scalar: float | None = scale**-2
    elif gemma:
        # llama.cpp's rule: the 27B models (46 and 62 layers) scale q by hidden / heads
        big = num_layers == (46 if arch == "gemma2" else 62)
        pre_attn_scalar = float(hidden // num_heads if big else head_dim)
    else:
        pre_attn_scalar = None
    attention_bias = arch == "qwen2"
    if not attention_bias and any(n.endswith((".attn_q.bias", ".attn_k.bias")) for n in tensors):
        raise ModelLoadError(f"{path}: attention biases are not supported for {arch} models")

    moe_arch = moe_architecture(arch, meta("expert_count", int, 0))
    moe = {} if moe_arch is None else moe_fields(meta, arch, num_layers, tensors,
                                                 meta("feed_forward_length", int), path)

    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = _field(reader, path, f"tokenizer.ggml.{key}", int, None)
        if token is not None and token not in eos:
            eos.append(token)

    return ModelConfig(
        architecture=moe_arch or _ARCHITECTURES[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length", int),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", float, 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=attention_bias,
        bos_token_id=_field(reader, path, "tokenizer.ggml.bos_token_id", int, None),
        eos_token_ids=eos,
        name=_field(reader, path, "general.name", str, None)
        or os.path.splitext(os.path.basename(path))[0],
        hidden_act="gelu_tanh" if gemma else "silu",
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
        rotary_dim=rope_dim if rope_dim != head_dim else None,
        embed_scale=hidden**0.5 if gemma else None,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        query_pre_attn_scalar=pre_attn_scalar,
        attn_logit_softcapping=meta("attn_logit_softcapping", float, None) if arch == "gemma2" else None,
        final_logit_softcapping=meta("final_logit_softcapping", float, None) if gemma else None,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=meta("rope.freq_base_swa", float, 10000.0) if arch == "gemma3" else None,
        **moe,
    )


def _sliding_window(reader: GGUFReader, path: str, arch: str,
                    num_layers: int) -> tuple[int | None, list[str] | None]:
    """(window, per-layer types) from {arch}.attention.sliding_window and, where present,
    {arch}.attention.sliding_window_pattern (a bool per layer, or n: every n-th global)."""
    window = _field(reader, path, f"{arch}.attention.sliding_window", int, None)
    if window is None or window <= 0:
        return None, None
    pattern = _field(reader, path, f"{arch}.attention.sliding_window_pattern", int,
                     _GLOBAL_EVERY.get(arch, 0))
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{path}: sliding_window_pattern has {len(pattern)} values "
                                 f"for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp: with n > 0 the last layer of every n is global; 0: all slide
        sliding = [pattern <= 0 or i % pattern < pattern - 1 for i in range(num_layers)]
    if not any(sliding):
        return None, None
    return window, [SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding]


def _rope_scaling(
    reader: GGUFReader,
    path: str,
    arch: str,
    tensors: dict[str, Any],
    head_dim: int,
    rope_theta: float,
) -> dict[str, Any] | None:
    """HF-style rope_scaling from GGUF metadata, or from a llama3 rope_freqs tensor."""

    def meta(suffix: str, kind: type, default: Any = None) -> Any:
        return _field(reader, path, f"{arch}.{suffix}", kind, default)

    if all(name in tensors for name in _ROPE_FACTORS):
        long, short = (_dequantize(tensors[n], path).reshape(-1).tolist() for n in _ROPE_FACTORS)
        if len(long) != head_dim // 2 or len(short) != head_dim // 2:
            raise ModelLoadError(f"{path}: rope factors need {head_dim // 2} values each")
        original = meta("rope.scaling.original_context_length", int)
        if original is None:
            raise ModelLoadError(f"{path}: rope factors without rope.scaling.original_context_length")
        scaling_lr: dict[str, Any] = {"rope_type": "longrope", "long_factor": long,
                                      "short_factor": short,
                                      "original_max_position_embeddings": original}
        attn_factor = meta("rope.scaling.attn_factor", float)
        if attn_factor is not None:
            scaling_lr["attention_factor"] = attn_factor
        return scaling_lr
    if _ROPE_FREQS in tensors:
        factors = _dequantize(tensors[_ROPE_FREQS], path).reshape(-1).astype(np.float64)
        if factors.size != head_dim // 2:
            raise ModelLoadError(
                f"{path}: {_ROPE_FREQS} has {factors.size} values, expected {head_dim // 2}"
            )
        return _llama3_from_rope_freqs(factors, head_dim, rope_theta, path)

    kind = meta("rope.scaling.type", str)
    factor = meta("rope.scaling.factor", float)
    if kind is None and meta("rope.scale_linear", float) is not None:
        # Older GGUFs stored linear scaling under a key of its own.
        kind, factor = "linear", meta("rope.scale_linear", float)
    if kind in (None, "none"):
        return None
    if factor is None:
        raise ModelLoadError(f"{path}: rope scaling type {kind!r} without a scaling factor")
    if kind == "linear":
        # llama.cpp writes factor 1 (or 0) for "no scaling"
        return None if factor in (0.0, 1.0) else {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        original = meta("rope.scaling.original_context_length", int)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        for suffix, hf_key in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.attn_factor", "attention_factor"),
        ):
            value = meta(suffix, float)
            if value is not None:
                scaling[hf_key] = value
        return scaling
    raise ModelLoadError(f"{path}: unsupported rope scaling type {kind!r}")


def _llama3_factors(
    wavelengths: np.ndarray, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """Per-dimension divisors of the RoPE frequencies under Llama 3 scaling."""
    smooth = (original / wavelengths - low) / (high - low)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(
        wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, mid)
    )


def _llama3_from_rope_freqs(
    factors: np.ndarray, head_dim: int, rope_theta: float, path: str
) -> dict[str, Any] | None:
    """Recover HF llama3 rope_scaling parameters from llama.cpp's precomputed factors.

    The factors depend only on `factor` and the two boundary wavelengths
    original/low and original/high, so fixing low_freq_factor = 1 (as every Llama 3
    release does) makes the solution unique. The candidate is accepted only if it
    reproduces the stored factors.
    """
    factor = float(factors.max())
    if np.allclose(factors, 1.0, rtol=1e-6):
        return None
    wavelengths = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    is_high = np.isclose(factors, 1.0, rtol=1e-5)
    is_low = np.isclose(factors, factor, rtol=1e-5)
    mid = ~(is_high | is_low)

    candidates: list[tuple[float, float, float]] = [(1.0, 4.0, 8192.0)]  # Llama 3.x values
    if mid.sum() >= 2:
        # In the smooth band s = original/(d*wavelength) - low/d with d = high - low,
        # linear in 1/wavelength; with low = 1 the fit gives d and original directly.
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[mid], smooth, 1)
        if intercept < 0:
            d = -1 / intercept
            candidates.insert(0, (1.0, 1.0 + d, slope * d))
    elif mid.sum() == 0 and is_high.any() and is_low.any():
        # A sharp cut: put both boundaries in the gap between the two classes.
        original = math.sqrt(wavelengths[is_high].max() * wavelengths[is_low].min())
        high = original / math.sqrt(wavelengths[is_high].max() * original)
        candidates.append((1.0, high, original))

    for low, high, original in candidates:
        # Prefer round numbers when they fit just as well (configs state integers).
        for o, h in ((round(original), round(high, 4)), (original, high)):
            if h <= low:
                continue
            if np.allclose(_llama3_factors(wavelengths, factor, low, h, o), factors, rtol=1e-3):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": float(h),
                    "original_max_position_embeddings": int(round(o)),
                }
    raise ModelLoadError(
        f"{path}: {_ROPE_FREQS} holds per-dimension RoPE factors that do not match Llama 3 "
        "rope scaling; this rope variant is not supported"
    )


def _hf_to_gguf_names(expected: dict[str, Any], arch: str, num_layers: int) -> dict[str, str]:
    """llama.cpp's tensor name for each HF name, from the gguf package's per-arch map (the
    same HF name can mean another GGUF tensor per arch: Llama's post_attention_layernorm
    is ffn_norm, Gemma's is post_attention_norm)."""
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    arch_id = by_name.get(arch, by_name["llama"])  # "mistral": llama.cpp's Llama layout
    tmap = gguf.get_tensor_name_map(arch_id, num_layers)
    # an MoE arch's map lacks the dense MLP of its mlp_only_layers: Llama's names then
    dense = gguf.get_tensor_name_map(by_name["llama"], num_layers)
    names = {}
    for hf in expected:
        g = (tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
             or dense.get_name(hf, try_suffixes=(".weight", ".bias")))
        if g is None:
            raise ModelLoadError(f"the gguf package has no {arch} name for tensor {hf}")
        names[hf] = g
    return names


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first; torch wants the reverse.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantize(tensor: Any, path: str, data: np.ndarray | None = None) -> np.ndarray:
    """A float32 array in torch shape (of `data`, a part of the tensor's rows, if given),
    never a view into the memory map."""
    qtype = tensor.tensor_type
    if qtype in _INTEGER_TYPES:
        raise ModelLoadError(f"{path}: tensor {tensor.name} has integer type {qtype.name}")
    part = data is not None
    data = tensor.data if data is None else data
    try:
        if qtype == GGMLQuantizationType.F32:
            array = np.array(data, dtype=np.float32)
        else:
            array = gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} uses {qtype.name} quantization, which the "
            "installed gguf package cannot dequantize"
        ) from e
    return array if part else array.reshape(_torch_shape(tensor))


def _float_weight(tensor: Any, path: str, n_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """A deferred linear's float weight, as the eager load would have made it."""
    array = _dequantize(tensor, path)
    return torch.from_numpy(_unpermute_qk(array, n_heads) if n_heads else array).to(dtype)


def _unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... whereas HF's
    rotate_half pairs x[i] with x[i + head_dim/2]; the converter reorders each
    head's rows from [first half, second half] to interleaved. Reverse it.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    return (
        weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
