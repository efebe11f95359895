#!/usr/bin/env bash
# Linnet's CPU kernels on ARM64 (NEON, dotprod, i8mm, bf16) without an ARM machine: an arm64 Debian
# root under qemu-user emulation, the aarch64 PyPI wheel of torch inside it, and the kernel tests run
# there. Correctness only: emulation is 10-50x slower than the hardware, so speed is "not measured".
#
#   sudo scripts/arm64_check.sh            # set up (once, ~15 min) and run the kernel tests
#   ROOT=/srv/arm64 scripts/arm64_check.sh setup | test | clean
#
# Needs root (debootstrap, chroot, binfmt_misc) and Debian's packages; steps from
# ../shared/arm64-emulation.md. The root is ~2 GB; `clean` removes it.
set -euo pipefail
ROOT=${ROOT:-/var/tmp/linnet-arm64}
REPO=$(cd "$(dirname "$0")/.." && pwd)
TORCH=${TORCH:-torch==2.9.1}  # aarch64's CPU wheel (PyPI's 2.13.0 for aarch64 is the 4.6 GB CUDA build)
TESTS=${TESTS:-tests/test_cpu_kernels.py}

setup() {
  command -v debootstrap >/dev/null && command -v qemu-aarch64-static >/dev/null ||
    { apt-get update -qq && apt-get install -y -qq qemu-user-static debootstrap binfmt-support >/dev/null; }
  # binfmt_misc is not mounted by default: without it the root's binaries cannot run
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  update-binfmts --enable qemu-aarch64 2>/dev/null || true
  if [ ! -x "$ROOT/bin/sh" ]; then
    debootstrap --arch=arm64 --variant=minbase bookworm "$ROOT" http://deb.debian.org/debian
  fi
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  chroot "$ROOT" /bin/sh -c 'command -v g++ >/dev/null && test -d /venv || { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-dev g++ >/dev/null; }'
  # pip checks the system store: the host's (which trusts this network's proxy), after apt's own
  mkdir -p "$ROOT/etc/ssl/certs"
  cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
  chroot "$ROOT" /bin/sh -c "test -x /venv/bin/python || python3 -m venv /venv"
  chroot "$ROOT" /venv/bin/pip install -q "$TORCH" 'setuptools>=77' numpy pytest ninja 'transformers>=4.56' typer rich filelock jinja2 \
    huggingface_hub tokenizers
}

run_tests() {
  rm -rf "$ROOT/linnet" && mkdir -p "$ROOT/linnet"
  git -C "$REPO" ls-files -z | (cd "$REPO" && xargs -0 cp --parents -t "$ROOT/linnet")
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  trap 'umount "$ROOT/proc" 2>/dev/null || true' EXIT
  chroot "$ROOT" /bin/sh -c "cd /linnet && /venv/bin/pip install -q --no-deps --no-build-isolation -e . &&
    uname -m && /venv/bin/python -c 'from linnet_core.backends.cpu import build; print(build.describe())' &&
    HOME=/root /venv/bin/python -m pytest -q -p no:cacheprovider $TESTS"
}

case "${1:-all}" in
  setup) setup ;;
  test) run_tests ;;
  all) setup && run_tests ;;
  clean) umount "$ROOT/proc" 2>/dev/null || true; rm -rf "$ROOT" ;;
  *) echo "usage: $0 [setup|test|all|clean]" >&2; exit 2 ;;
esac
