"""Compiling Linnet's CPU kernels (csrc/) with torch's C++ extension builder and importing the result,
keyed by the sources, the flags and the PyTorch install; what doctor says without building."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import BackendUnavailable
from ...private_dirs import check_private, make_private_dir

SOURCES = [Path(__file__).parent / "csrc" / f for f in (
    "gemv.cpp", "quant_linear.cpp", "huge_pages.cpp", "decode_attention.cpp", "step_ops.cpp", "attention_block.cpp", "ops.cpp",
    "bindings.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / f for f in ("vec.h", "dynamic_for.h")]  # in the build key: the sources include them
COMMON_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
QUANT_CODES = {"q8_0": 0, "q4_0": 1}  # quant_linear's format argument
LEVEL_ENV = "LINNET_CPU_LEVEL"


@dataclass(frozen=True)
class Level:
    """One build of the kernels: the CPU features it needs and the flags that let the compiler use
    them (csrc/vec.h picks its code from the compiler's own macros)."""

    name: str  # what LINNET_CPU_LEVEL takes and csrc/vec.h's level_name() returns
    label: str  # what doctor and bench print
    arch: str  # platform.machine()
    needs: tuple[str, ...]  # /proc/cpuinfo flags (x86-64) or HWCAP names (ARM64)
    cflags: tuple[str, ...]


_X86_FLOOR = ("-mavx2", "-mfma", "-mf16c")
# Highest first: dispatch takes the first one the CPU has, as ATen's and ggml's CPU backends do.
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma", "f16c")
_AVX512_FLAGS = _X86_FLOOR + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni")
LEVELS = (
    Level("avx512-amx", "AVX-512 BF16/VNNI + AMX", "x86_64", _AVX512 + ("amx_tile", "amx_bf16"),
          _AVX512_FLAGS + ("-mamx-tile", "-mamx-bf16")),
    Level("avx512", "AVX-512 BF16/VNNI", "x86_64", _AVX512, _AVX512_FLAGS),
    Level("avx2-vnni", "AVX2 + AVX-VNNI", "x86_64", ("avx2", "fma", "f16c", "avx_vnni"), _X86_FLOOR + ("-mavxvnni",)),
    Level("avx2", "AVX2", "x86_64", ("avx2", "fma", "f16c"), _X86_FLOOR),
    Level("neon-i8mm", "NEON + dotprod + i8mm + bf16", "aarch64", ("asimd", "asimddp", "i8mm", "bf16"),
          ("-march=armv8.2-a+dotprod+i8mm+bf16",)),
    Level("neon-dotprod-bf16", "NEON + dotprod + bf16", "aarch64", ("asimd", "asimddp", "bf16"),
          ("-march=armv8.2-a+dotprod+bf16",)),
    Level("neon-dotprod", "NEON + dotprod", "aarch64", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod",)),
    Level("neon", "NEON", "aarch64", ("asimd",), ("-march=armv8-a",)),
)
FLOOR = {"x86_64": "AVX2, FMA and F16C", "aarch64": "NEON"}

# ARM64 features from the kernel's HWCAP words (/proc/cpuinfo may be another machine's under emulation)
_AT_HWCAP, _AT_HWCAP2 = 16, 26
_ARM_HWCAP = {"asimd": (_AT_HWCAP, 1 << 1), "asimddp": (_AT_HWCAP, 1 << 20), "i8mm": (_AT_HWCAP2, 1 << 13),
              "bf16": (_AT_HWCAP2, 1 << 14)}


@functools.lru_cache(maxsize=None)
def cpu_features() -> frozenset[str]:
    """This CPU's feature names: /proc/cpuinfo's flags on x86-64, HWCAP bits on ARM64."""
    if platform.machine() in ("aarch64", "arm64"):
        try:
            getauxval = ctypes.CDLL(None).getauxval
            getauxval.restype = ctypes.c_ulong
            words = {w: getauxval(w) for w in (_AT_HWCAP, _AT_HWCAP2)}
        except (OSError, AttributeError):
            return frozenset()
        return frozenset(name for name, (word, bit) in _ARM_HWCAP.items() if words[word] & bit)
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.split(":", 1)[-1].split())


def _arch() -> str:
    machine = platform.machine()
    return "aarch64" if machine == "arm64" else machine


def runnable_levels() -> list[Level]:
    """The levels this CPU runs, highest first (an AVX-512 machine runs the AVX2 builds too)."""
    have = cpu_features()
    return [lv for lv in LEVELS if lv.arch == _arch() and all(f in have for f in lv.needs)]


def level_named(name: str) -> Level:
    for lv in LEVELS:
        if lv.name == name:
            return lv
    raise BackendUnavailable(f"{LEVEL_ENV}={name} is not a kernel level; the levels are "
                             f"{', '.join(lv.name for lv in LEVELS)}",
                             hint=f"unset {LEVEL_ENV} to take the highest level this CPU runs")


def chosen_level() -> Level | None:
    """The level the kernels build for: LINNET_CPU_LEVEL's if set (it must be one this CPU runs),
    else the highest this CPU runs; None below the floor."""
    forced = os.environ.get(LEVEL_ENV, "").strip()
    runnable = runnable_levels()
    if forced:
        level = level_named(forced)
        if level not in runnable:
            here = ", ".join(lv.name for lv in runnable) or "none"
            raise BackendUnavailable(f"{LEVEL_ENV}={forced} asks for {level.label}, which this CPU lacks "
                                     f"(it runs: {here})", hint=f"unset {LEVEL_ENV} to take the highest level this CPU runs")
        return level
    return runnable[0] if runnable else None


def candidate_levels() -> list[Level]:
    """The levels to try building, in order: the forced one alone, else every level this CPU runs,
    highest first (a compiler too old for the highest one's flags, AMX's say, builds the next)."""
    level = chosen_level()
    if level is None:
        return []
    return [level] if os.environ.get(LEVEL_ENV, "").strip() else runnable_levels()


def unusable() -> str | None:
    """Why the kernels cannot serve here before any build is tried, or None."""
    if os.environ.get("LINNET_DECODE_KERNELS", "1") == "0":
        return "turned off by LINNET_DECODE_KERNELS=0"
    if chosen_level() is None:
        floor = FLOOR.get(_arch())
        lacks = f"this CPU lacks {floor}" if floor else f"Linnet has no kernels for {platform.machine()} CPUs"
        return (f"{lacks}: decode uses oneDNN and SDPA (several times slower at 16 bits) and q8_0/q4_0 "
                "weights are refused on torch and inductor")
    return None


def describe() -> str:
    """The kernel level for doctor lines and bench records: its label and name, or why there is none."""
    try:
        why = unusable()
        level = chosen_level()
    except BackendUnavailable as e:
        return f"none ({e})"
    return f"none ({why})" if why else f"{level.label} ({level.name})"


def register_fakes() -> None:
    """Output shapes of csrc/ops.cpp's operators, for torch.compile's tracing."""
    @torch.library.register_fake("linnet_kernels::linear")
    def _(x, handle, out_features, bias=None):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("linnet_kernels::embedding")
    def _(ids, handle, width):
        return ids.new_empty((*ids.shape, width), dtype=torch.float32)

    @torch.library.register_fake("linnet_kernels::experts")
    def _(x, weights, gate, up, down, width, act):
        return torch.empty_like(x)

    @torch.library.register_fake("linnet_kernels::decode_attention")
    def _(q, k_cache, v_cache, layer, slots, pos, window, scale, softcap=0.0):
        return torch.empty_like(q)


class KernelBuildNotice(UserWarning):
    """Said once, when a first CPU session stops ~100 s to build the kernels."""

    prefix = "note"


def cflags(level: Level) -> list[str]:
    return [*COMMON_CFLAGS, *level.cflags]


@functools.lru_cache(maxsize=None)
def _key(level: Level) -> str:
    """The source, the level's flags, this PyTorch and where it lies: torch's builder rebuilds for
    another install's headers, so two virtual environments sharing one folder would rebuild each other's."""
    sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    build = f"{torch.__version__}:{torch.__file__}:{level.name}:{' '.join(cflags(level))}"
    return hashlib.sha256(sources + build.encode()).hexdigest()[:16]


def build_dir(level: Level) -> Path:
    """Per machine and level, not per artifact cache (a build serves every cache): $LINNET_KERNELS,
    else ~/.cache/linnet/kernels (XDG_CACHE_HOME honoured)."""
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(os.environ.get("LINNET_KERNELS") or user_cache / "linnet" / "kernels")
    return root / f"decode_kernels-{level.name}-{_key(level)}"


def module_name(level: Level) -> str:
    """The shared object's module name (build_dir(level) / f"{name}.so"): a cross-compiled build put
    there is imported as is (scripts/arm64_check.sh)."""
    return f"linnet_decode_kernels_{level.name.replace('-', '_')}_{_key(level)}"


def build_extension(level: Level):
    name, build = module_name(level), build_dir(level)
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
        warnings.warn(f"building Linnet's CPU kernels for this machine ({level.label}; once, about 100 s)",
                      KernelBuildNotice, stacklevel=2)
    try:  # the `ninja` wheel's binary: on PATH only in an activated virtual environment
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    # torch's builder locks the folder (concurrent first uses wait for one build) and reuses it after.
    clear_stale_lock(build)
    return load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=cflags(level),
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
    try:
        why = unusable()
        level = chosen_level()
    except BackendUnavailable as e:
        return False, str(e)
    if why:
        return False, why
    if any(build_dir(level).glob("*.so")):
        return True, f"{level.label}, built in {build_dir(level)}"
    return True, f"{level.label}, built at the first CPU session (about 100 s; needs g++ and ninja)"
