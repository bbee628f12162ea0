"""Running a model: the Llama model, RoPE, attention backends and their kernels, quantized
linear, and the runner that owns the KV cache. Imports workers.loading, kvcache and the core."""
