"""A decode step of a dense model on the CPU as one C call (csrc/decode_step.c).

Run op by op, a small model's decode step is mostly Python dispatch and OpenMP wake-ups
(~25 torch calls and 5 parallel regions per layer); the C kernel runs the layers, the final
norm and the LM head in one parallel region. It takes steps in which every stream decodes
one token, on float32 CPU models whose linears all read GGUF blocks, with RMSNorm, a gated
SiLU or tanh-GELU MLP and rotate-half RoPE (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3);
anything else (prefill chunks, MoE layers, tensor-parallel ranks, LoRA, other weight types)
runs the layers op by op, with the same matmul kernels.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

import torch

from kvserve.workers.loading.quant_format import EXACT_QTYPES, QTYPES, QuantizedWeight
from kvserve.workers.model.layers.mlp import GatedMLP
from kvserve.workers.model.quant_linear import MAX_ROWS, Linear, scratch

if TYPE_CHECKING:
    from kvserve.kvcache.device_cache import DeviceKVCache
    from kvserve.workers.model.attention import AttentionMetadata
    from kvserve.workers.model.layers.decoder import DecoderModel

log = logging.getLogger(__name__)

_p, _i64, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# weight types the int8 step also keeps repacked 8 rows at a time (csrc/qgemm.c)
PACKED_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# the copies are made only when they take at most this share of the memory available then:
# a model that fits but whose copy would not still loads (slower steps and prompt chunks)
COPY_MEMORY_SHARE = 0.5


class _Lin(ctypes.Structure):
    pass


# parts / n_parts: rows stacked from linears of different types (csrc/decode_step.c's ds_lin)
_Lin._fields_ = [("w", _p), ("bias", _p), ("N", _i64), ("K", _i64), ("row_bytes", _i64), ("qtype", _i64),
                 ("wp", _p), ("parts", ctypes.POINTER(_Lin)), ("n_parts", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin),
        ("in_norm", _p), ("post_attn_norm", _p), ("pre_mlp_norm", _p), ("post_mlp_norm", _p),
        ("q_norm", _p), ("k_norm", _p), ("k_cache", _p), ("v_cache", _p), ("cos", _p), ("sin", _p),
        ("scale", _f), ("softcap", _f), ("window", _i64), ("rot", _i64), ("act", _i64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("n_layers", _i64), ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64),
        ("inter", _i64), ("bs", _i64), ("exact", _i64), ("eps", _f), ("pad_", _f),
        ("final_norm", _p), ("head", _Lin), ("layers", _p), ("all_packed", _i64), ("kv16", _i64),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuDecodeStep:
    """The C decode step bound to one model's weights; `why_not` says why a model is not
    taken (None when it is)."""

    def __init__(self, model: DecoderModel, lib: Any, exact: bool) -> None:
        self.lib = lib
        self.exact = exact
        self.why_not = _why_not(model, exact)
        if self.why_not is not None:
            return
        cfg = model.cfg
        linears = [model.lm_head, *(lin for ly in model.layers
                                    for lin in (ly.attn.qkv, ly.attn.o, ly.mlp.gate_up, ly.mlp.down))]
        # the repacked copies' bytes, and whether they are made (`repack_skipped`: why not)
        need = 0 if exact else sum(_repacked_bytes(lin, lib) for lin in linears)
        self.repack_skipped: str | None = None
        avail = available_memory()
        if need and avail is not None and need > COPY_MEMORY_SHARE * avail:
            self.repack_skipped = (f"the repacked weights ({need / 2**20:.0f} MiB) would take more "
                                   f"than half the memory available ({avail / 2**20:.0f} MiB)")
            log.warning("decode step without repacked weights: %s; steps of 2+ rows and prompt "
                        "chunks run slower", self.repack_skipped)
            need = 0
        self.repacked_bytes = need
        pack = bool(need)
        keep: list[Any] = []  # tensors whose pointers the structures hold
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.attn, layer.mlp
            assert isinstance(mlp, GatedMLP)
            ly = layers[i]
            ly.qkv, ly.o = _lin(attn.qkv, keep, lib, pack), _lin(attn.o, keep, lib, pack)
            ly.gate_up, ly.down = _lin(mlp.gate_up, keep, lib, pack), _lin(mlp.down, keep, lib, pack)
            for field in ("in_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm"):
                norm = getattr(layer, field.replace("in_norm", "input_norm"))
                setattr(ly, field, _ptr(norm.weight) if norm is not None else None)
            ly.q_norm = _ptr(attn.q_norm.weight) if attn.q_norm is not None else None
            ly.k_norm = _ptr(attn.k_norm.weight) if attn.k_norm is not None else None
            rope = attn.rope
            keep += [rope.cos, rope.sin]
            ly.cos, ly.sin, ly.rot = rope.cos.data_ptr(), rope.sin.data_ptr(), rope.rotary_dim
            ly.scale = attn.spec.scale
            ly.softcap = attn.spec.softcap or 0.0
            ly.window = attn.spec.window or 0
            ly.act = 0 if mlp.act == "silu" else 1
        m = _Model()
        m.n_layers, m.hidden = len(model.layers), cfg.hidden_size
        first = model.layers[0].attn
        m.hq, m.hkv, m.d = first.hq, first.hkv, first.d
        m.inter = model.layers[0].mlp.inter  # type: ignore[attr-defined]
        m.exact = int(exact)
        m.eps = model.norm.eps
        m.final_norm = model.norm.weight.data_ptr()
        m.head = _lin(model.lm_head, keep, lib, pack)
        m.layers = ctypes.cast(layers, _p)
        lins = [m.head] + [getattr(ly, f) for ly in layers for f in ("qkv", "o", "gate_up", "down")]
        m.all_packed = int(all(lin.wp for lin in lins))
        self.model, self.layers, self.keep = m, layers, keep
        self.model_ref = model
        self.cache_ptr: int | None = None

    def accepts(self, meta: AttentionMetadata, n_tokens: int) -> bool:
        """Whether the step is one the kernel runs: every stream decodes one token, read
        through the C decode-attention kernel's plan."""
        step = meta.prepared
        if self.why_not is not None or step is None or not getattr(step, "all_decode", False):
            return False
        if getattr(step, "dec_tables", None) is None or step.dec_rows is not None:
            return False
        return not self.exact or n_tokens <= MAX_ROWS

    def _bind_cache(self, cache: DeviceKVCache) -> None:
        """Each layer's K/V pointers (the pool is allocated once; re-bound if it moves)."""
        ptr = cache.kv.data_ptr()
        if ptr == self.cache_ptr:
            return
        self.model.bs = cache.block_size
        self.model.kv16 = int(cache.kv.dtype == torch.float16)
        for i in range(len(self.model_ref.layers)):
            k, v = cache.layer(i)
            self.layers[i].k_cache, self.layers[i].v_cache = k.data_ptr(), v.data_ptr()
        self.cache_ptr = ptr

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 cache: DeviceKVCache, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] of the rows `logits_indices` of a decode step; x [B, hidden],
        the embeddings, is the residual stream and is overwritten."""
        self._bind_cache(cache)
        step = meta.prepared
        b = x.shape[0]
        x = x.contiguous()
        tables, lens = step.dec_tables, step.dec_lens
        rows = logits_indices.to(torch.int64).contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        logits = torch.empty((rows.shape[0], self.model.head.N), dtype=torch.float32)
        mp = ctypes.byref(self.model)
        buf = scratch(self.lib.decode_step_scratch_bytes(mp, b))
        rc = self.lib.decode_step(
            mp, x.data_ptr(), b, pos.data_ptr(), slots.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), rows.data_ptr(), rows.shape[0], logits.data_ptr(),
            buf.data_ptr(), torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"decode_step rejected the model's geometry (rc={rc})")
        return logits


def bind_rows(model: DecoderModel, lib: Any) -> None:
    """The op-by-op forward's norms, RoPE and MLP activations run the C step's code, so a
    row gives the same bits in either path: with 8-bit activations a last-bit difference
    would become a different rounding, and a request's tokens would depend on whether its
    step held a prompt chunk."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return
    model.norm.lib = lib
    for layer in model.layers:
        for norm in (layer.input_norm, layer.pre_mlp_norm, layer.post_attn_norm, layer.post_mlp_norm,
                     layer.attn.q_norm, layer.attn.k_norm):
            if norm is not None:
                norm.lib = lib
        layer.attn.rope.lib = lib
        mlps = getattr(layer.mlp, "experts", [layer.mlp])
        for mlp in mlps:
            if isinstance(mlp, GatedMLP):
                mlp.lib = lib


def available_memory() -> int | None:
    """The host's available memory in bytes (MemAvailable), None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _quants(linear: Any) -> tuple[QuantizedWeight, ...]:
    """The raw weights a linear reads: its one fused weight, or its parts of different types."""
    return (linear.quant,) if linear.quant is not None else tuple(linear.parts or ())


def _copy_bytes(q: QuantizedWeight, lib: Any) -> int:
    """The bytes of the repacked copy of one raw weight (0: none)."""
    if q.qtype not in PACKED_QTYPES or q.shape[0] % 8:
        return 0
    return max(0, lib.qgemm_pack_bytes(QTYPES[q.qtype][0], q.shape[0], q.shape[1]))


def _repacked_bytes(linear: Any, lib: Any) -> int:
    """The bytes of the repacked copies `_lin` makes of this linear (0: none)."""
    return sum(_copy_bytes(q, lib) for q in _quants(linear))


def _lin(linear: Any, keep: list[Any], lib: Any, pack: bool) -> _Lin:
    if linear.quant is None:  # parts of different types, each its own _Lin (and copy)
        parts = (_Lin * len(linear.parts))()
        for i, q in enumerate(linear.parts):
            parts[i] = _single_lin(q, keep, lib, pack)
        keep.append(parts)
        out = _Lin()
        out.N, out.K = sum(q.shape[0] for q in linear.parts), linear.parts[0].shape[1]
        out.parts, out.n_parts, out.qtype = ctypes.cast(parts, ctypes.POINTER(_Lin)), len(parts), -1
        # "has its copy" (all_packed) when every part has one; the step reads the parts' own
        out.wp = parts[0].wp if all(p.wp for p in parts) else None
    else:
        out = _single_lin(linear.quant, keep, lib, pack)
    if linear.bias is not None:
        bias = linear.bias.float().contiguous()
        keep.append(bias)
        out.bias = bias.data_ptr()
    return out


def _single_lin(q: QuantizedWeight, keep: list[Any], lib: Any, pack: bool) -> _Lin:
    keep.append(q.data)
    out = _Lin()
    out.w, out.N, out.K, out.row_bytes = q.data.data_ptr(), q.shape[0], q.shape[1], q.data.shape[1]
    out.qtype = QTYPES[q.qtype][0]
    size = _copy_bytes(q, lib) if pack else 0
    if size:
        # a second copy, repacked 8 rows at a time, read by the step at every row count,
        # prompt chunks included (its memory, Q4_K's 3% more than the original, for 1.2-1.9x
        # at 2-64 rows and 1.3-2x at prefill sizes: docs/benchmarks.md, "Small row counts");
        # the original serves every other reader of the weights
        packed = torch.empty(size, dtype=torch.uint8)
        if lib.qgemm_pack(out.qtype, q.data.data_ptr(), q.shape[0], q.shape[1], q.data.shape[1],
                          packed.data_ptr()) == 0:
            keep.append(packed)
            out.wp = packed.data_ptr()
    return out


def _why_not(model: DecoderModel, exact: bool) -> str | None:
    """Why the C step cannot run this model (None: it can)."""
    if model.tp is not None:
        return "tensor-parallel ranks run op by op"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "float32 CPU models only"
    types = EXACT_QTYPES if exact else tuple(QTYPES)
    linears: list[Any] = [model.lm_head]
    first = model.layers[0]
    for layer in model.layers:
        if not isinstance(layer.mlp, GatedMLP):
            return "Mixture-of-Experts layers run op by op"
        attn = layer.attn
        linears += [attn.qkv, attn.o, layer.mlp.gate_up, layer.mlp.down]
        if (attn.hq, attn.hkv, attn.d) != (first.attn.hq, first.attn.hkv, first.attn.d) \
                or layer.mlp.inter != first.mlp.inter:  # type: ignore[attr-defined]
            return "layers of different shapes"
        if attn.d % 32 or attn.rope.rotary_dim % 2:
            return f"head_dim {attn.d} is not a multiple of 32"
        norms = [layer.input_norm, layer.pre_mlp_norm, layer.post_attn_norm, layer.post_mlp_norm,
                 attn.q_norm, attn.k_norm]
        if any(n is not None and n.eps != model.norm.eps for n in norms):
            return "norms with different eps"
    for lin in linears:
        qs = _quants(lin) if isinstance(lin, Linear) else ()
        bad = [q.qtype for q in qs if q.qtype not in types]
        if not qs or bad:
            return f"a linear's weights are {bad[0] if bad else 'float'}, not one of {', '.join(types)}"
    return None
