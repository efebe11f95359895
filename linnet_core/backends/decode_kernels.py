"""Linnet's own CPU kernels for decode steps (kernels/*.cpp), built once per environment.

- `gemv_bf16`, `gemv_f16`: 16-bit matrix-vector products for one or two token rows. At batch 1 a
  decode step reads every weight once; these stream it one weight row at a time (a plain read's
  speed), bfloat16 with AVX-512 BF16's dot product as ggml's, float16 widened to float32 in registers.
- `quant_linear`: activations times weights held as GGUF q8_0 / q4_0 blocks (quant.py), as llama.cpp
  multiplies them: activations rounded to int8 blocks, int32 block sums by AVX-512 VNNI, over
  blocks repacked once at load (8 rows interleaved). A float32 path (dequantizing in registers,
  row by row) streamed q4_0 at 15.6 GB/s on this machine class; this one 36-47, a plain read of
  memory's speed (`bench/quant_gemv.py`), and prompts run 2.7x faster than float32 F.linear.
- `gemm_f16`: float16 prompts in register tiles, the weights widened in registers as llama.cpp's
  tinyBLAS does (2x MKL's float32 GEMM over widened copies, ~7x PyTorch's CPU float16 GEMM).
- `repack_f16_rows8`, `packed_half_linear`: float16 weights copied once at load 8 rows interleaved,
  decode's GEMV widening x once for 8 rows in one stream (~16% faster than the row kernel at
  Qwen3-4B's shapes) and the prompt tiles over the same layout; a head tied to the token table
  keeps the row layout and the kernels above.
- `ops.cpp`: the kernels as C++ operators (`torch.ops.linnet_kernels.*`) for compiled steps, and
  `half_linear`, float16's choice between the GEMV and the GEMM.
- `decode_attention`: one-token queries over the KV cache in place (float32, float16, bfloat16),
  where the generic path copies each row's keys and values and calls SDPA (~6x slower at
  Qwen3-4B's shapes, measured on a cold cache as in a step).
- `step_ops.cpp`: RMSNorm, rope and the cache write, one call each for an eager step, where the
  emitted ATen ops are 3-8 calls (~1 ms of a 5.7 ms decode step at the 191M Qwen3's shape), and
  argmax (ATen's reads 16-bit logits one at a time: ~120 us at a 32000-token vocabulary); silu,
  silu * up and the residual add + norm for the eager step's fused groups (torch_groups).
- `attention_block.cpp`: a decode step's attention block (split into heads, q/k norms, rope, cache
  write, decode attention) in one call composing the kernels above.
Built with torch's C++ extension builder (g++ and ninja, ~100 s on 2 cores) into ~/.cache/linnet/kernels (or
$LINNET_KERNELS), keyed by the PyTorch install and the sources, checked against the generic ops,
and used only where the CPU has AVX-512 BF16 and VNNI; anything missing means the generic ops as before,
never an error. `LINNET_DECODE_KERNELS=0` turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from ..private_dirs import check_private, make_private_dir
from ..quant import dequantize, int8_blocks, quantize

SOURCES = [Path(__file__).parent / "kernels" / f for f in (
    "gemv.cpp", "quant_linear.cpp", "huge_pages.cpp", "decode_attention.cpp", "step_ops.cpp", "attention_block.cpp", "ops.cpp",
    "bindings.cpp")]
HEADERS = [Path(__file__).parent / "kernels" / "simd.h"]  # in the build key: the sources include them
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


def _unusable() -> str | None:
    """Why the kernels cannot serve here before any build is tried, or None."""
    if os.environ.get("LINNET_DECODE_KERNELS", "1") == "0":
        return "turned off by LINNET_DECODE_KERNELS=0"
    if not cpu_has_bf16_dot():
        return "this CPU lacks AVX-512 BF16 or VNNI: decode uses oneDNN and SDPA"
    return None


def reference_attention(q, k_cache, v_cache, layer: int, slots, pos, window: int, scale: float):
    """What `decode_attention` computes, by the generic path the generated step takes without it
    (torch_emit's `attend`): q [B, H, D] at positions pos [B] of cache rows slots [B] -> [B, H, D]."""
    attend = generic("attend")
    kv_len = int(pos.max()) + 1
    out = attend(q[:, None], pos[:, None], slots, kv_len, k_cache, v_cache, layer, window or None, scale,
                 q.shape[1] != k_cache.shape[2])  # [B, 1, H, D]
    return out[:, 0]


def generic(helper: str):
    """The generated module's helper `helper` (attend, rms_norm, apply_rope, write_cache, argmax, silu), as every
    emitted step has it: what each kernel standing in for it must compute."""
    return _prelude()[helper]


@functools.lru_cache(maxsize=None)
def _prelude() -> dict:
    from .torch_emit import PRELUDE

    namespace: dict = {}
    exec(PRELUDE, namespace)
    return namespace


def _small_ops_disagree(ext) -> str | None:
    """Which of the step's small-op kernels computes otherwise than its helper, or None: rope, the
    cache write and argmax exactly, RMSNorm within a float32 rounding of its sum (another summation
    order), silu and silu_mul within a 16-bit rounding (the exponential is a polynomial, ATen's
    Sleef's), the attention block exactly as its helper over the unfused kernels."""
    from .cpu_kernels import DecodeAttention, StepKernels

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        qkv = torch.randn(2, 3, 160, generator=g).to(dtype)
        q, k, v = (t.reshape(2, 3, -1, 32) for t in qkv.split([96, 32, 32], dim=-1))  # strided views, as a step's
        w = torch.randn(32, generator=g).to(dtype)
        want, got = generic("rms_norm")(q, w, 1e-6), ext.rms_norm(q, w, 1e-6)
        if not torch.allclose(got.float(), want.float(), rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-6):
            return "RMSNorm"
        pos = torch.tensor([[4, 5, 6], [0, 1, 2]])
        for rot in (32, 16):  # whole and partial rotary
            cos, sin = generic("rope_table")(pos, torch.rand(rot // 2, generator=g), dtype)
            if not torch.equal(ext.rope(q, cos, sin), generic("apply_rope")(q, cos, sin)):
                return "rope"
        caches = [torch.zeros(2, 3, 1, 8, 32, dtype=dtype) for _ in range(4)]  # [L, rows, KV, S, D]
        rows = torch.tensor([[1, 1, 1], [2, 0, 2]])
        generic("write_cache")(k, v, pos, rows, caches[0], caches[1], 1)
        ext.write_cache(k, v, pos, rows, caches[2], caches[3], 1)
        if not (torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])):
            return "the cache write"
        gate = qkv[..., :40]  # a strided view, as the gate half of a fused projection
        if not torch.allclose(ext.silu(gate).float(), generic("silu")(gate).float(), rtol=1e-2, atol=1e-6):
            return "silu"
        if not torch.allclose(ext.silu_mul(qkv[..., :80]).float(), generic("silu_mul")(qkv[..., :80]).float(),
                              rtol=2e-2, atol=1e-6):
            return "silu_mul"
        caches = [torch.zeros(2, 3, 1, 8, 32, dtype=dtype) for _ in range(4)]  # three one-token rows
        qkv1, pos1, rows1 = qkv[:1], torch.tensor([[4, 0, 6]]), torch.tensor([[1, 0, 2]])
        index = (rows1[0], None, torch.zeros(0, dtype=torch.long), None, None, None)
        got = ext.attention_block(qkv1, 3, 1, w, w, 1e-6, cos[:1], sin[:1], pos1, rows1, caches[0], caches[1], 1, 0, 0.2)
        small = StepKernels(decode_attention=DecodeAttention(ext), rms_norm=ext.rms_norm, rope=ext.rope,
                            write_cache=ext.write_cache)  # the unfused kernels
        want = generic("attention_block")(qkv1, 3, 1, 32, w, w, 1e-6, cos[:1], sin[:1], pos1, rows1, *index,
                                          caches[2], caches[3], 1, None, 0.2, small)
        if not (torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])):
            return "attention block"
        logits = torch.randn(3, 50, generator=g).to(dtype)
        logits[1, 7] = logits[1, 30] = logits[1].max() + 1  # a tie: the first
        logits[2, 9] = float("nan")
        if not torch.equal(ext.argmax(logits), generic("argmax")(logits)):
            return "argmax"
    return None


def _self_check(ext) -> str | None:
    """Why the built kernels cannot be trusted, or None: each against the generic ops on small cases."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=g).to(torch.bfloat16)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        if not torch.allclose(ext.gemv_bf16(x, w).float(), F.linear(x, w).float(), atol=5e-2, rtol=2e-2):
            return "its GEMV disagreed with F.linear"
    wh = torch.randn(50, 80, generator=g).half()  # K % 32 == 16: the GEMV's last step; 50 % 6: a short tile
    for rows in (1, 2, 7):
        xh = torch.randn(rows, 80, generator=g).half()
        want = F.linear(xh.float(), wh.float())
        if not torch.allclose(ext.half_linear(xh, wh).float(), want, atol=5e-2, rtol=5e-3):
            return "its float16 linear disagreed with F.linear"
        if not torch.allclose(ext.packed_half_linear(xh, ext.repack_f16_rows8(wh), 50).float(), want, atol=5e-2, rtol=5e-3):
            return "its packed float16 linear disagreed with F.linear"
    for fmt in QUANT_CODES:
        for rows in (1, 3, 5, 11):  # token rows in and past one register pass; 43 rows: a padded group
            x, wq = torch.randn(rows, 96, generator=g), quantize(torch.randn(43, 96, generator=g), fmt)
            want = F.linear(int8_blocks(x), dequantize(wq, fmt))
            got = ext.quant_linear(x, ext.repack_rows8(wq, QUANT_CODES[fmt]), QUANT_CODES[fmt], 43)
            if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
                return f"its {fmt} linear disagreed with F.linear over the rounded activations and dequantized weights"
    k, v = torch.randn(2, 3, 2, 12, 32, generator=g), torch.randn(2, 3, 2, 12, 32, generator=g)  # [L, rows, KV, S, D]
    q, slots, pos = torch.randn(2, 4, 32, generator=g), torch.tensor([2, 0]), torch.tensor([11, 4])
    for window in (0, 3):
        got = ext.decode_attention(q, k, v, 1, slots, pos, window, 0.2)
        if not torch.allclose(got, reference_attention(q, k, v, 1, slots, pos, window, 0.2), atol=1e-4, rtol=1e-4):
            return "its attention disagreed with SDPA"
    which = _small_ops_disagree(ext)
    return f"its {which} disagreed with the generated step's" if which else None


@functools.lru_cache(maxsize=None)
def _loaded():
    """(the built extension, None) or (None, why not); built and checked once."""
    why = _unusable()
    if why:
        return None, why
    try:
        ext = _build()
        why = _self_check(ext)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the generic ops serve
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return None, f"they could not be built ({type(e).__name__}: {last})"
    if why:
        return None, why
    _register_fakes()
    return ext, None


def _register_fakes() -> None:
    """Output shapes of kernels/ops.cpp's operators, for torch.compile's tracing."""
    @torch.library.register_fake("linnet_kernels::linear")
    def _(x, handle, out_features, bias=None):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("linnet_kernels::embedding")
    def _(ids, handle, width):
        return ids.new_empty((*ids.shape, width), dtype=torch.float32)

    @torch.library.register_fake("linnet_kernels::decode_attention")
    def _(q, k_cache, v_cache, layer, slots, pos, window, scale):
        return torch.empty_like(q)


def extension():
    """The built extension (`gemv_bf16`, `decode_attention`), or None (and `why_not()` says why)."""
    return _loaded()[0]


def why_not() -> str:
    return _loaded()[1] or ""


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


def _build():
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
    why = _unusable()
    if why:
        return False, why
    if any(build_dir().glob("*.so")):
        return True, f"built in {build_dir()}"
    return True, "built at the first CPU session (about 100 s; needs g++ and ninja)"


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); the kernel for one or two bf16 token rows, F.linear otherwise."""
    ext = extension()
    if ext is None:
        return F.linear(x, weight, bias)
    y = ext.bf16_linear(x, weight)  # the same choice as the compiled steps' operator (ops.cpp)
    return y if bias is None else y + bias


def repack(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """`fmt` blocks [N, K / 32 * block bytes] -> the same blocks as `quant_linear` reads them (8 rows
    interleaved per block, q8_0's quants stored 128 above their value; a copy)."""
    return extension().repack_rows8(blocks, QUANT_CODES[fmt])


def quant_linear(x: torch.Tensor, packed: torch.Tensor, fmt: str, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32) @ W.T (+ bias), W [out_features, K] as `fmt` blocks from `repack`."""
    y = extension().quant_linear(x, packed, QUANT_CODES[fmt], out_features)
    return y if bias is None else y + bias


def attention_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `decode_attention` takes caches of `dtype` with heads of `head_dim` (whole 16-lane vectors)."""
    return dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim % 16 == 0
