#!/usr/bin/env bash
# Set up (first run only) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# The Ray dashboard browser test drives Debian's headless Chromium (chromium, chromium-driver):
# installed here where this shell can (root with apt-get), else that one test is skipped.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "kvserve test: installing chromium and chromium-driver (apt-get)" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } \
            || echo "kvserve test: installing chromium failed; the browser test will be skipped" >&2
    else
        echo "kvserve test: chromium and chromium-driver are not installed and this shell cannot" \
             "install them (needs root and apt-get); the Ray dashboard browser test will be" \
             "skipped. To run it: sudo apt-get install chromium chromium-driver" >&2
    fi
fi
VENV="${KVSERVE_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest -q "$@"
