#!/usr/bin/env bash
# Linnet's CPU kernels on ARM64 (NEON, dotprod, i8mm, bf16) without an ARM machine: an arm64 Debian
# root under qemu-user emulation, the aarch64 PyPI wheel of torch inside it, and the kernel tests run
# there. Correctness only: emulation is 10-50x slower than the hardware, so speed is "not measured".
#
#   sudo scripts/arm64_check.sh            # set up (once, ~15 min) and run the kernel tests
#   ROOT=/srv/arm64 scripts/arm64_check.sh setup | test | clean
#
# Needs root (debootstrap, chroot, binfmt_misc) and Debian's packages; steps from
# ../shared/arm64-emulation.md. The root is ~2 GB; `clean` removes it. The kernels are compiled by
# the host's cross compiler (g++-aarch64-linux-gnu) with the flags and module name Linnet's builder
# would use inside the root, where the emulated g++ took over 40 minutes; the tests then import
# that build as they would a native one (CROSS=0 builds inside the root instead).
set -euo pipefail
ROOT=${ROOT:-/var/tmp/linnet-arm64}
REPO=$(cd "$(dirname "$0")/.." && pwd)
TORCH=${TORCH:-torch==2.9.1}  # aarch64's CPU wheel (PyPI's 2.13.0 for aarch64 is the 4.6 GB CUDA build)
# the kernel tests and the quantized ones on every family fixture; not inductor's (its C++ compiles under
# emulation take hours) nor the rebuilds (lower levels, a fresh machine)
TESTS=${TESTS:-tests/test_cpu_kernels.py tests/test_quantized.py -k \"not lower_level and not fresh_machine and not inductor and not compiled \
and (kernel or repacking or cpu_kernels)\"}

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

cross_build() {  # the level's build, compiled on the host for the root's torch and Python
  command -v aarch64-linux-gnu-g++ >/dev/null || apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null
  local plan
  plan=$(chroot "$ROOT" /bin/sh -c "cd /linnet && HOME=/root /venv/bin/python -c '
from linnet_core.backends.cpu import build
lv = build.chosen_level()
print(build.module_name(lv), build.build_dir(lv), \" \".join(build.cflags(lv)), \" \".join(str(p) for p in build.SOURCES))'" |
    tail -1)
  local name dir cflags sources torch=$ROOT/venv/lib/python3.11/site-packages/torch
  name=$(echo "$plan" | cut -d' ' -f1)
  dir=$(echo "$plan" | cut -d' ' -f2)
  cflags=$(echo "$plan" | cut -d' ' -f3- | sed 's| /linnet/.*||')
  sources=$(echo "$plan" | grep -o '/linnet/linnet_core/[^ ]*' | sed "s|^|$ROOT|")
  echo "cross-compiling $name ($cflags)"
  mkdir -p "$ROOT$dir" && chmod 700 "$ROOT$dir" "$(dirname "$ROOT$dir")"
  # shellcheck disable=SC2086
  aarch64-linux-gnu-g++ -shared -fPIC -std=c++20 -DTORCH_EXTENSION_NAME="$name" -DTORCH_API_INCLUDE_EXTENSION_H \
    -isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include" -isystem "$ROOT/usr/include/python3.11" \
    -isystem "$ROOT/usr/include/aarch64-linux-gnu/python3.11" -idirafter "$ROOT/usr/include" $cflags $sources \
    -L"$torch/lib" -lc10 -ltorch_cpu -ltorch -ltorch_python -o "$ROOT$dir/$name.so"
}

run_tests() {
  rm -rf "$ROOT/linnet" && mkdir -p "$ROOT/linnet"
  git -C "$REPO" ls-files -z | (cd "$REPO" && xargs -0 cp --parents -t "$ROOT/linnet")
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  trap 'umount "$ROOT/proc" 2>/dev/null || true' EXIT
  chroot "$ROOT" /bin/sh -c "cd /linnet && /venv/bin/pip install -q --no-deps --no-build-isolation -e ."
  [ "${CROSS:-1}" = 0 ] || cross_build
  chroot "$ROOT" /bin/sh -c "cd /linnet && uname -m &&
    /venv/bin/python -c 'from linnet_core.backends.cpu import build; print(build.describe())' &&
    HOME=/root /venv/bin/python -m pytest -q -p no:cacheprovider $TESTS"
}

case "${1:-all}" in
  setup) setup ;;
  test) run_tests ;;
  all) setup && run_tests ;;
  clean) umount "$ROOT/proc" 2>/dev/null || true; rm -rf "$ROOT" ;;
  *) echo "usage: $0 [setup|test|all|clean]" >&2; exit 2 ;;
esac
