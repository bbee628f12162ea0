"""Layers every model family is built from: norms, MLPs, the attention block, RoPE."""
