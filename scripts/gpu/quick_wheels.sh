#!/usr/bin/env bash
# The wheels `run.sh quick` needs on a GPU machine (Python 3.12, manylinux x86_64, no package
# registry), fetched here into the git-ignored .whl/quick; the quick run's `wheels` step
# installs them with one `pip install --target /tmp/site`.
#
# Run from the repository root on a machine with pip and network: bash scripts/gpu/quick_wheels.sh
# What the GPU image lacks on quick's paths, found by the dry run in a look-alike of the image
# (QUICK_DRY=1, scripts/gpu/image_venv.py):
#   pydantic (+ pydantic_core, annotated-types, typing-inspection, and typing_extensions >= 4.16,
#     which pydantic needs and the image may hold older): kvserve.config, kvserve.sampling and
#     the CLI's serve parser import it, so every bench and test does
#   jsonschema (+ referencing, rpds-py, jsonschema-specifications): test_async_scheduling.py
#     imports it and validates the guided streams' JSON with it
#   xgrammar (+ apache-tvm-ffi): the grammar masks of the guided streams in
#     test_async_scheduling.py (asynchronous scheduling with a grammar in flight)
# Not needed: gguf (only GGUF files load through it; quick's models are HF directories), Ray and
# the serving stack (wheels.sh, for the serving steps). Versions: the development venv's.
set -eu
PY=${PY:-python3}
DEST=${QUICK_WHEELS:-.whl/quick}
PKGS=(
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
)
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "${PKGS[@]}"
n=$(find "$DEST" -name "*.whl" | wc -l)
if [ "$n" -ne "${#PKGS[@]}" ]; then
  echo "quick_wheels.sh: $n wheels for ${#PKGS[@]} packages" >&2; exit 1
fi
find "$DEST" -name "*.whl" -printf '%10s  %f\n' | sort -k2
# what travels with the call: the working tree's tracked files, the wheels and .gpu (3.4 MB)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
whl=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
gpu=$(du -cb .gpu 2>/dev/null | tail -1 | cut -f1)
total=$((tree + whl + ${gpu:-0}))
echo "quick: $whl bytes of wheels + $tree of working tree + ${gpu:-0} of .gpu = $total (a call carries at most 67108864)"
if [ "$total" -gt 33554432 ]; then echo "quick_wheels.sh: over 32 MiB, half a call's limit" >&2; exit 1; fi
