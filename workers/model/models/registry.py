"""Model families by architecture: ModelConfig.architecture (the loaders map HF
`model_type` and GGUF `general.architecture` to it) -> the class that builds the model."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kvserve.errors import ModelLoadError
from kvserve.workers.loading.model_config import ModelConfig
from kvserve.workers.loading.quant_format import QuantizedWeight
from kvserve.workers.model.layers.decoder import DecoderModel
from kvserve.workers.model.layers.parallel import TensorParallel
from kvserve.workers.model.layers.weights import Weights
from kvserve.workers.model.models.gemma2 import Gemma2ForCausalLM
from kvserve.workers.model.models.gemma3 import Gemma3ForCausalLM
from kvserve.workers.model.models.llama import LlamaForCausalLM
from kvserve.workers.model.models.mixtral import MixtralForCausalLM
from kvserve.workers.model.models.phi3 import Phi3ForCausalLM
from kvserve.workers.model.models.qwen3 import Qwen3ForCausalLM
from kvserve.workers.model.models.qwen3_moe import Qwen3MoeForCausalLM

# (config, weights, device, dtype, max positions) -> model
FAMILIES: dict[str, Callable[[ModelConfig, Weights, torch.device, torch.dtype, int], DecoderModel]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
}


def build_model(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    quantized: dict[str, QuantizedWeight] | None = None,
    quantized_decode: bool = True,
    tp: TensorParallel | None = None,
    cpu_matmul: str = "exact",
) -> DecoderModel:
    """The family's model over `weights`; with `tp`, a tensor-parallel rank's (its shards of
    the weights, as the loader read them for its rank)."""
    family = FAMILIES.get(cfg.architecture)
    if family is None:
        raise ModelLoadError(f"{cfg.name or 'model'}: no model family for {cfg.architecture!r}")
    # The linears read the raw GGUF blocks through a C kernel (CPU float32 only; Linear
    # ignores them elsewhere): 8-bit activations at every batch, or float32 ones at small
    # batches (cpu_matmul "exact"); without a compiler, fp32 everywhere.
    lib = step_lib = None
    int8 = cpu_matmul == "int8"
    if quantized and quantized_decode and device.type == "cpu" and dtype == torch.float32:
        from kvserve.workers.model.cpu_kernels import load_decode_step, load_qgemv

        step_lib = load_decode_step()
        lib = step_lib if int8 else load_qgemv()
    w = Weights(cfg, weights, device, dtype, quantized, lib, tp, int8=int8)
    model = family(cfg, w, device, dtype, max_positions)
    model.tp = tp
    if step_lib is not None and lib is not None:
        from kvserve.workers.model.cpu_decode import CpuDecodeStep, bind_rows

        model.cpu_step = CpuDecodeStep(model, step_lib, exact=not int8)
        bind_rows(model, step_lib)
    return model
