"""Model families, one file each, over the shared layers; `registry.py` maps names to them."""
