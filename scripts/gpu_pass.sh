#!/usr/bin/env bash
# The GPU pass in one command (see scripts/gpu_pass.py): on a GPU machine with CUDA builds of torch
# and JAX already installed and no network, it installs Linnet from this tree and writes its
# results into $OUT within about 8 minutes.
#   OUT=/tmp/out scripts/gpu_pass.sh            the pass
#   OUT=/tmp/out scripts/gpu_pass.sh --dry-run  the same steps on the CPU at test sizes
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the pass writes its results into}"
exec "${PYTHON:-python3}" scripts/gpu_pass.py --out "$OUT" "$@"
