#!/usr/bin/env bash
# Serve the default model on Ray: gRPC on :9000, OpenAI-compatible HTTP on :8000.
#   bash scripts/serve.sh                      # one worker
#   bash scripts/serve.sh --workers 2 --api-key secret
# Then, from another shell:
#   .venv/bin/kvserve generate --server 127.0.0.1:9000 --prompt "The capital of France is"
#   curl localhost:8000/v1/completions -H 'content-type: application/json' \
#        -d '{"prompt": "The capital of France is", "max_tokens": 16}'
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
VENV="${KVSERVE_VENV:-.venv}"
exec "$VENV/bin/kvserve" serve "$@"
