"""Per-stream paged KV cache: device block pool, block tables, prefix sharing."""
