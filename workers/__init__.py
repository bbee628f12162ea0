"""Model code, loaders, tokenizer, runner and sampler (the worker side)."""
