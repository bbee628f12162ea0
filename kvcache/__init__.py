"""Per-stream paged KV cache: block pool, block tables with plan/commit/rollback, device KV
tensor, host tier and its copies. Imports only the kvserve core (config, errors)."""
