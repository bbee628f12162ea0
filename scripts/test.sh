#!/usr/bin/env bash
# Set up (first run only) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
VENV="${KVSERVE_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest -q "$@"
