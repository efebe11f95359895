"""Compiling Linnet's CPU kernels (csrc/) with torch's C++ extension builder and importing the result,
keyed by the sources, the flags and the PyTorch install; what doctor says without building."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import time
import warnings
from pathlib import Path

import torch

from ...private_dirs import check_private, make_private_dir

SOURCES = [Path(__file__).parent / "csrc" / f for f in (
    "gemv.cpp", "quant_linear.cpp", "huge_pages.cpp", "decode_attention.cpp", "step_ops.cpp", "attention_block.cpp", "ops.cpp",
    "bindings.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "simd.h"]  # in the build key: the sources include them
MAX_ROWS = 2  # token rows the kernel takes: decode steps of one or two sequences
CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16", "avx512_vnni")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
QUANT_CODES = {"q8_0": 0, "q4_0": 1}  # quant_linear's format argument


def cpu_has_bf16_dot() -> bool:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return False
    have = set(flags.split(":", 1)[-1].split())
    return all(f in have for f in CPU_FLAGS)


def unusable() -> str | None:
    """Why the kernels cannot serve here before any build is tried, or None."""
    if os.environ.get("LINNET_DECODE_KERNELS", "1") == "0":
        return "turned off by LINNET_DECODE_KERNELS=0"
    if not cpu_has_bf16_dot():
        return "this CPU lacks AVX-512 BF16 or VNNI: decode uses oneDNN and SDPA"
    return None


def register_fakes() -> None:
    """Output shapes of csrc/ops.cpp's operators, for torch.compile's tracing."""
    @torch.library.register_fake("linnet_kernels::linear")
    def _(x, handle, out_features, bias=None):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("linnet_kernels::embedding")
    def _(ids, handle, width):
        return ids.new_empty((*ids.shape, width), dtype=torch.float32)

    @torch.library.register_fake("linnet_kernels::decode_attention")
    def _(q, k_cache, v_cache, layer, slots, pos, window, scale):
        return torch.empty_like(q)


class KernelBuildNotice(UserWarning):
    """Said once, when a first CPU session stops ~100 s to build the kernels."""

    prefix = "note"


@functools.lru_cache(maxsize=None)
def _key() -> str:
    """The source, this PyTorch and where it lies: torch's builder rebuilds for another install's
    headers, so two virtual environments sharing one folder would rebuild each other's."""
    sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    build = f"{torch.__version__}:{torch.__file__}:{' '.join(CFLAGS)}"
    return hashlib.sha256(sources + build.encode()).hexdigest()[:16]


def build_dir() -> Path:
    """Per machine, not per artifact cache (a build serves every cache): $LINNET_KERNELS, else
    ~/.cache/linnet/kernels (XDG_CACHE_HOME honoured)."""
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(os.environ.get("LINNET_KERNELS") or user_cache / "linnet" / "kernels")
    return root / f"decode_kernels-{_key()}"


def build_extension():
    name, build = f"linnet_decode_kernels_{_key()}", build_dir()
    built = build / f"{name}.so"
    make_private_dir(build)  # the shared object is imported: a folder others can write is their code
    check_private(build.parent)
    if built.exists():
        check_private(built)  # the key names the sources, flags and PyTorch: imported as is, without the
        try:  # builder, which costs ~0.1 s of imports and a ninja run per process
            return _import(name, built)
        except (ImportError, OSError):  # half-written by a build still running: the builder waits for it
            pass
    from torch.utils.cpp_extension import load

    if not any(build.glob("*.so")):
        warnings.warn("building Linnet's CPU decode kernels for this machine (once, about 100 s)", KernelBuildNotice,
                      stacklevel=2)
    try:  # the `ninja` wheel's binary: on PATH only in an activated virtual environment
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    # torch's builder locks the folder (concurrent first uses wait for one build) and reuses it after.
    clear_stale_lock(build)
    return load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)


STALE_LOCK_S = 900  # a build takes ~2 minutes on 2 cores: a lock this old outlived its builder


def clear_stale_lock(build: Path) -> bool:
    """Remove the builder's lock file left by a process killed mid-build (torch's builder would wait on
    it forever); whether one was removed. A lock younger than STALE_LOCK_S is a build still running."""
    lock = build / "lock"
    try:
        if time.time() - lock.stat().st_mtime < STALE_LOCK_S:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    warnings.warn(f"removed a stale build lock left by an interrupted build ({lock})", KernelBuildNotice, stacklevel=2)
    return True


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def status() -> tuple[bool, str]:
    """(usable, what doctor says) without building: a build takes ~100 s, doctor takes none."""
    why = unusable()
    if why:
        return False, why
    if any(build_dir().glob("*.so")):
        return True, f"built in {build_dir()}"
    return True, "built at the first CPU session (about 100 s; needs g++ and ninja)"
