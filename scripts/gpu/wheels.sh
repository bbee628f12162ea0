#!/usr/bin/env bash
# The wheels a GPU host (Python 3.12, torch, transformers; no Ray, pydantic or grpcio 1.85)
# lacks for `kvserve serve`, `bench serve` and the served-path tests, fetched here into the
# git-ignored .whl/ for a host that cannot reach a package registry.
#
# Run from the repository root on a machine with pip and network: bash scripts/gpu/wheels.sh
# The versions are the development venv's (ray must match it). The list is what importing
# Ray, Serve, the dashboard agent's metrics (ray.dashboard.optional_deps), kvserve's serving
# modules and the tests' clients (grpc, openai) loads, less what the GPU image already has
# (aiohttp, anyio, attrs, click, h11, msgpack, numpy, packaging, prometheus-client, psutil,
# pyyaml, requests, uvloop, yarl, ...). grpcio and protobuf are here although the image has
# them: kvserve's generated stubs need grpcio 1.85.1 and protobuf 7.
#
# A device call carries at most 64 MiB, and the ray wheel alone is ~79 MB, so the ray wheel
# is split in two parts (below 60 MB each) and the wheels travel in two calls on the same
# warm machine (it goes back ~30 s after a call, so make the second call at once):
#   call 1 carries .whl/call1: every wheel but ray, and ray's first part
#   call 2 carries .whl/call2: ray's second part, then runs `bash scripts/gpu/run.sh wheels ...`
# .whl/call1 stays on the machine between the calls (an ignored path already there is kept);
# run.sh's `wheels` step joins the parts and installs everything with one
# `pip install --target /tmp/site` (a second --target install would replace the shared
# google/ package folder of protobuf, googleapis-common-protos and google-api-core).
set -eu
PY=${PY:-python3}
DEST=${WHEELS_DIR:-.whl}
RAY=ray==2.60.0
PKGS=(
  pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
  grpcio==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  aiohttp-cors==0.8.1 colorful==0.5.8
  opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 google-auth==2.62.2
  googleapis-common-protos==1.76.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-semantic-conventions==0.66b2
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  sniffio==1.3.1
  openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
)
PART=40M  # ray's parts, both below 60 MB: 42 MB + 16 MB of other wheels in call 1, 37 MB in call 2
dl() { "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"; }
mkdir -p "$DEST/call1" "$DEST/call2" "$DEST/dl"
dl "$DEST/call1" "${PKGS[@]}"
dl "$DEST/dl" "$RAY"
ray_whl=$(ls "$DEST"/dl/ray-*.whl)
name=$(basename "$ray_whl")
rm -f "$DEST"/call1/"$name".part-* "$DEST"/call2/"$name".part-*
split -b "$PART" -d "$ray_whl" "$DEST/dl/$name.part-"
mv "$DEST/dl/$name.part-00" "$DEST/call1/"
mv "$DEST/dl/$name.part-01" "$DEST/call2/"
if ls "$DEST"/dl/"$name".part-* >/dev/null 2>&1; then
  echo "wheels.sh: the ray wheel needs more than two parts" >&2; exit 1
fi
rm -f "$ray_whl"
ls -l "$DEST/call1" "$DEST/call2" | awk 'NF > 5 {printf "%10d  %s\n", $5, $9}'
# what else travels with each call: the working tree's tracked files
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for d in call1 call2; do
  n=$(du -cb "$DEST/$d"/* | tail -1 | cut -f1)
  echo "$d: $n bytes of wheels + $tree of working tree (a call carries at most 67108864)"
  if [ $((n + tree)) -gt 67108864 ]; then echo "wheels.sh: $d is over 64 MiB" >&2; exit 1; fi
done
