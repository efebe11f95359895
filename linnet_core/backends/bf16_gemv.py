"""A bfloat16 matrix-vector kernel of Linnet's own for CPU decode (kernels/gemv_bf16.cpp).

At batch 1 a decode step reads every weight once. oneDNN's bf16 kernel streams ~32 GB/s on this
machine class; this one, with AVX-512 BF16's dot product as ggml's, ~41 (microbenchmark; ~33 in
a Qwen3-4B step). It is built once per environment with torch's C++ extension builder (g++ and
ninja, ~25 s) into ~/.cache/linnet/kernels (or $LINNET_KERNELS), keyed by the PyTorch install
and the source, checked against F.linear, and used only where the CPU has AVX-512 BF16; anything
missing means oneDNN as before, never an error. `LINNET_CPU_GEMV=0` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).parent / "kernels" / "gemv_bf16.cpp"
MAX_ROWS = 2  # token rows the kernel takes: decode steps of one or two sequences
CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]


def cpu_has_bf16_dot() -> bool:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return False
    have = set(flags.split(":", 1)[-1].split())
    return all(f in have for f in CPU_FLAGS)


def _unusable() -> str | None:
    """Why the kernel cannot serve here before any build is tried, or None."""
    if os.environ.get("LINNET_CPU_GEMV", "1") == "0":
        return "turned off by LINNET_CPU_GEMV=0"
    if not cpu_has_bf16_dot():
        return "this CPU has no AVX-512 BF16: bfloat16 linears use oneDNN"
    return None


@functools.lru_cache(maxsize=None)
def _loaded():
    """(the built extension's `gemv_bf16`, None) or (None, why not); built and checked once."""
    why = _unusable()
    if why:
        return None, why
    try:
        fn = _build().gemv_bf16
        g = torch.Generator().manual_seed(0)
        w = torch.randn(80, 96, generator=g).to(torch.bfloat16)
        for rows in range(1, MAX_ROWS + 1):
            x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
            if not torch.allclose(fn(x, w).float(), F.linear(x, w).float(), atol=5e-2, rtol=2e-2):
                return None, "it disagreed with F.linear"
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: oneDNN serves instead
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return None, f"it could not be built ({type(e).__name__}: {last})"
    return fn, None


def kernel():
    """The built extension's `gemv_bf16`, or None (and `why_not()` says why)."""
    return _loaded()[0]


def why_not() -> str:
    return _loaded()[1] or ""


class KernelBuildNotice(UserWarning):
    """Said once, when a first bfloat16 CPU session stops ~25 s to build the kernel."""

    prefix = "note"


def _key() -> str:
    """The source, this PyTorch and where it lies: torch's builder rebuilds for another install's
    headers, so two virtual environments sharing one folder would rebuild each other's."""
    return hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__}:{torch.__file__}".encode()).hexdigest()[:16]


def build_dir() -> Path:
    """Per machine, not per artifact cache (a build serves every cache): $LINNET_KERNELS, else
    ~/.cache/linnet/kernels (XDG_CACHE_HOME honoured)."""
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(os.environ.get("LINNET_KERNELS") or user_cache / "linnet" / "kernels")
    return root / f"gemv_bf16-{_key()}"


def _build():
    from torch.utils.cpp_extension import load

    build = build_dir()
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        warnings.warn("building Linnet's bfloat16 CPU kernel for this machine (once, about 25 s)", KernelBuildNotice,
                      stacklevel=2)
    try:  # the `ninja` wheel's binary: on PATH only in an activated virtual environment
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    # torch's builder locks the folder (concurrent first uses wait for one build) and reuses it after.
    return load(name=f"linnet_gemv_bf16_{_key()}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)


def status() -> tuple[bool, str]:
    """(usable, what doctor says) without building: a build takes ~25 s, doctor takes none."""
    why = _unusable()
    if why:
        return False, why
    if any(build_dir().glob("*.so")):
        return True, f"built in {build_dir()}"
    return True, "built at the first bfloat16 CPU session (about 25 s; needs g++ and ninja)"


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); the kernel for one or two bf16 token rows, F.linear otherwise."""
    rows = x.numel() // x.shape[-1]
    fn = kernel()
    if fn is None or rows > MAX_ROWS or x.shape[-1] % 32 or x.dtype != torch.bfloat16:
        return F.linear(x, weight, bias)
    y = fn(x.contiguous(), weight)
    return y if bias is None else y + bias
