"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over packed, unpadded steps.

Inputs are the concatenated new tokens of every stream in a step ([T]); the
per-stream structure lives only in the attention metadata. Q/K/V and gate/up
projections are fused into single matmuls, which matters on a 2-core CPU where
each extra small GEMM costs launch overhead per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.errors import ModelLoadError
from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.loading.quant_format import QuantizedWeight, concat_rows
from kvserve.workers.model.attention import AttentionBackend, AttentionMetadata
from kvserve.workers.model.quant_linear import Linear
from kvserve.workers.model.rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    return (F.rms_norm(xf, (x.shape[-1],), None, eps) * weight.float()).to(x.dtype)


class Layer:
    def __init__(
        self,
        w: dict[str, torch.Tensor],
        i: int,
        cfg: ModelConfig,
        qw: dict[str, QuantizedWeight],
        lib: object | None,
    ) -> None:
        p = f"model.layers.{i}."
        a = p + "self_attn."

        def fused(*names: str, bias: torch.Tensor | None = None) -> Linear:
            weight = w[names[0]] if len(names) == 1 else torch.cat([w[n] for n in names])
            return Linear(weight, bias, concat_rows([qw.get(n) for n in names]), lib)

        self.input_norm = w[p + "input_layernorm.weight"]
        self.post_norm = w[p + "post_attention_layernorm.weight"]
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        self.qkv = fused(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", bias=qkv_bias)
        self.o = fused(a + "o_proj.weight")
        self.gate_up = fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.down = fused(p + "mlp.down_proj.weight")


class LlamaModel:
    """Inference-only model; weights are plain tensors (no autograd, no nn.Module state)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        quantized: dict[str, QuantizedWeight] | None = None,
        quantized_decode: bool = True,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        w = {k: t.to(device=device, dtype=dtype) for k, t in weights.items()}
        # Small-batch linears read the raw GGUF blocks through the C kernel (CPU float32
        # only; Linear ignores them elsewhere); without a compiler, fp32 everywhere.
        qw = quantized or {}
        lib = None
        if qw and quantized_decode and device.type == "cpu" and dtype == torch.float32:
            from kvserve.workers.model.cpu_kernels import load_qgemv

            lib = load_qgemv()
        try:
            self.embed = w["model.embed_tokens.weight"]
            self.norm = w["model.norm.weight"]
            head = "lm_head.weight" if "lm_head.weight" in w and not cfg.tie_word_embeddings else "model.embed_tokens.weight"
            self.lm_head = Linear(w[head], None, qw.get(head), lib)
            self.layers = [Layer(w, i, cfg, qw, lib) for i in range(cfg.num_layers)]
        except KeyError as e:
            raise ModelLoadError(f"{cfg.name or 'model'}: missing weight {e.args[0]}") from e
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.inter = cfg.intermediate_size
        self.rope = RotaryEmbedding(cfg, max_positions, device, dtype)
        # CUDA: the layer's small ops run as fused Triton kernels (workers/model/triton_fused.py)
        self.fused = device.type == "cuda" and _has_triton()

    def _fused_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       cache: DeviceKVCache, attn: AttentionBackend,
                       logits_indices: torch.Tensor) -> torch.Tensor:
        from kvserve.workers.model.triton_fused import add_rms_norm, rope_cache, silu_mul

        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        n_tok = input_ids.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        res = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        mlp_out: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            h = add_rms_norm(res if mlp_out is None else mlp_out, layer.input_norm, eps,
                             None if mlp_out is None else res)
            qkv = layer.qkv(h)
            kc, vc = cache.layer(i)
            q = rope_cache(qkv, positions, self.rope.cos, self.rope.sin, kc, vc, meta.slot_mapping,
                           hq, hkv, d)
            o = attn.attend(i, q, cache, meta)  # type: ignore[attr-defined]
            h = add_rms_norm(layer.o(o.reshape(n_tok, hq * d)), layer.post_norm, eps, res)
            mlp_out = layer.down(silu_mul(layer.gate_up(h)))
        assert mlp_out is not None
        last = res[logits_indices] + mlp_out[logits_indices]
        return self.lm_head(add_rms_norm(last, self.norm, eps)).float()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        cache: DeviceKVCache,
        attn: AttentionBackend,
        logits_indices: torch.Tensor,  # [B] rows of T whose logits are wanted
    ) -> torch.Tensor:  # [B, vocab] float32
        if self.fused and hasattr(attn, "attend"):
            return self._fused_forward(input_ids, positions, meta, cache, attn, logits_indices)
        cfg = self.cfg
        n_tok = input_ids.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.rope.tables(positions)
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.rope.apply(q.view(n_tok, hq, d), cos, sin)
            k = self.rope.apply(k.view(n_tok, hkv, d), cos, sin)
            o = attn.forward(i, q, k, v.reshape(n_tok, hkv, d), cache, meta)
            x = x + layer.o(o.reshape(n_tok, hq * d))
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).split([self.inter, self.inter], dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = rms_norm(x[logits_indices], self.norm, cfg.rms_norm_eps)
        return self.lm_head(x).float()


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
