#!/usr/bin/env bash
# Set up (first run only) and chat with the embedded default model (SmolLM2-135M-Instruct).
# Usage: scripts/demo.sh ["your message"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KVSERVE_VENV:-.venv}"
MSG="${1:-What is the capital of France? Answer in one sentence.}"
echo "user> $MSG"
printf 'assistant> '
exec "$VENV/bin/kvserve" chat "$MSG"
