"""Engine settings: one pydantic model shared by the offline API, the CLI and the workers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.speculative import SpeculativeConfig, parse_speculative_config


class EngineConfig(BaseModel):
    """Settings of one engine (one model on one device)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(
        None, description="GGUF file, HF directory, or Hub name (org/name[@rev], "
                          "org/name:file.gguf[@rev]); None = default model",
    )
    kv_cache_tokens: int = Field(32768, ge=16, description="device KV pool capacity in tokens")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weights and KV dtype; auto = float32 on CPU, bfloat16 on CUDA"
    )
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="KV cache dtype; auto = float16 where the CPU runs GGUF blocks with "
                            "8-bit activations (cpu_matmul int8) and dtype is auto, as llama.cpp "
                            "keeps K/V (half the bytes decode attention reads), else the model's "
                            "dtype; on CUDA only the model's dtype"
    )
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    attention_backend: Literal["auto", "torch", "triton", "flash"] = "auto"
    max_model_len: int | None = Field(
        None, ge=1, description="cap on prompt + output tokens; default = the model's context"
    )
    enable_prefix_caching: bool = True
    max_num_seqs: int = Field(64, ge=1, description="streams batched together at most")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="token budget of one step (decodes plus prefill chunks)"
    )
    preemption_policy: Literal["newest", "least_computed", "largest"] = Field(
        "newest", description="which running stream gives up its KV when a step does not fit"
    )
    admission_lookahead_tokens: int = Field(
        128, ge=0, description="free KV kept per running stream when admitting new prompts"
    )
    enforce_eager: bool = Field(
        False, description="CUDA: run every step eagerly instead of replaying CUDA graphs"
    )
    cuda_graph_max_tokens: int = Field(
        2048, ge=0, description="CUDA: steps with prompt tokens up to this many tokens replay "
        "CUDA graphs too (by token and stream count); 0 = decode steps only",
    )
    async_scheduling: bool | None = Field(
        None, description="plan and launch step N+1 while step N runs, its sampled ids staying "
        "on the device; None = on for CUDA, off on the CPU (no device to overlap with)",
    )
    quantized_decode: bool = Field(
        True, description="CPU float32: linears read the GGUF's quantized blocks (off: "
        "dequantized float32 weights everywhere)"
    )
    cpu_matmul: Literal["int8", "exact"] = Field(
        "int8", description="CPU float32 on quantized blocks: 'int8' quantizes each matmul's "
        "activations to 8 bits per 32 values and multiplies them with integer dot products "
        "(llama.cpp's scheme) at every batch size, and attends prompt rows row by row so a "
        "row's bits do not depend on its chunk; 'exact' keeps the activations float32 "
        "(blocks read at up to 16 rows, MKL's float32 GEMM on dequantized weights above)",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads (of all ranks together); None = all cores")
    tensor_parallel_size: int = Field(
        1, ge=1, description="devices (ranks, one process each) the engine spans: attention "
        "heads, KV heads, MLP and vocabulary split across them",
    )
    seed: int = 0
    host_cache_gib: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="host-memory KV tier size; None = a share of free RAM (capped), 0 = off",
    )
    host_restore_policy: Literal["cost", "copy", "recompute"] = Field(
        "cost", description="how a parked stream's KV comes back: by copy from the host tier "
        "or recomputed, whichever the measured costs say is cheaper ('cost'), or always one way",
    )
    max_evictions_per_request: int = Field(
        4, ge=0, description="a stream is evicted at most this often while others can be"
    )
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (on when `loras` names any): device slots are "
        "allocated and adapters can be loaded at run time",
    )
    loras: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters loaded at start: name -> PEFT adapter "
        "directory or Hub id (org/name[@rev]); a request names one in its `model`",
    )
    max_loras: int = Field(
        4, ge=1, le=256, description="LoRA adapters in device slots at once (a step mixes at most "
        "this many)",
    )
    max_lora_rank: int = Field(16, ge=1, le=1024, description="the largest LoRA rank accepted")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters kept in host memory (least recently used dropped "
        "beyond it; never one with live requests); None = 4 x max_loras",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None, description="speculative decoding (vLLM's names: method ngram|draft_model, "
        "num_speculative_tokens, prompt_lookup_min/max, model, disable_by_batch_size); "
        "a dict or its JSON text; None = off",
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, v: object) -> object:
        if isinstance(v, str):
            return parse_speculative_config(v)
        return v

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda") and not (v.startswith("cuda:") and v[5:].isdigit()):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> EngineConfig:
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async_scheduling is not available with tensor_parallel_size > 1: "
                             "the other ranks take each step's input ids from the host")
        if self.lora_enabled and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not served with tensor_parallel_size > 1 (the "
                             "adapters' products are not split across ranks)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras}): an adapter in a device slot stays in host "
                             "memory")
        bad = [n for n in self.loras if not n or n == "default" or ":" in n]
        if bad:
            raise ValueError(f"LoRA adapter name {bad[0]!r}: names must be non-empty, not "
                             "'default', without ':'")
        spec = self.speculative_config
        if spec is not None:
            if self.async_scheduling:
                raise ValueError("async_scheduling is not available with speculative decoding: "
                                 "a step's proposals need the tokens of the step before on the "
                                 "host")
            if spec.method == "draft_model" and self.tensor_parallel_size > 1:
                raise ValueError("a draft model runs on one device: speculative method "
                                 "'draft_model' is not available with tensor_parallel_size > 1 "
                                 "(method 'ngram' is)")
            if self.lora_enabled:
                raise ValueError("speculative decoding is not available with LoRA adapters: "
                                 "proposals are not verified under a stream's adapter yet")
        return self

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.loras)

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras

    @property
    def num_blocks(self) -> int:
        return max(1, self.kv_cache_tokens // self.block_size)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        if self.speculative_config is not None:
            return False  # proposals need the last step's tokens on the host
        return self.resolved_device().startswith("cuda") and self.tensor_parallel_size == 1

    def rank_threads(self) -> int:
        """torch threads of each rank on the CPU: the engine's threads shared by its ranks."""
        from kvserve.hardware import available_cores

        total = self.num_threads if self.num_threads is not None else available_cores()
        return max(1, total // self.tensor_parallel_size)

    def rank_devices(self) -> list[str]:
        """The device of each rank: on CUDA consecutive GPUs from the configured one."""
        device = self.resolved_device()
        if not device.startswith("cuda"):
            return ["cpu"] * self.tensor_parallel_size
        first = int(device[5:]) if device.startswith("cuda:") else 0
        return [f"cuda:{first + r}" for r in range(self.tensor_parallel_size)]

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"

    def resolved_kv_cache_dtype(self, int8_cpu: bool = False) -> str:
        """The KV cache's dtype. `int8_cpu`: the model runs GGUF blocks with 8-bit activations
        on the CPU, whose attention kernel reads a float16 cache (auto picks it there unless
        dtype is pinned: dtype names the KV's too). On CUDA the kernels read the model's."""
        kv = self.kv_cache_dtype
        if kv == "auto":
            kv = "float16" if int8_cpu and self.dtype == "auto" else self.resolved_dtype()
        if kv != self.resolved_dtype() and self.resolved_device().startswith("cuda"):
            raise ValueError(f"kv_cache_dtype {kv!r} differs from the model's dtype "
                             f"({self.resolved_dtype()}): on CUDA the KV cache holds the model's "
                             "dtype (set dtype instead)")
        return kv
