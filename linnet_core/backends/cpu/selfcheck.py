"""The built kernels held against what they stand in for: the generated step's helpers (its PRELUDE),
F.linear over the same rounding, SDPA; a kernel that disagrees keeps the whole build out."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...quant import dequantize, int8_blocks, quantize
from ..torch_emit import PRELUDE
from .build import QUANT_CODES
from .step_kernels import DecodeAttention, StepKernels


def reference_attention(q, k_cache, v_cache, layer: int, slots, pos, window: int, scale: float,
                        softcap: float | None = None):
    """What `decode_attention` computes, by the generic path the generated step takes without it
    (torch_emit's `attend`): q [B, H, D] at positions pos [B] of cache rows slots [B] -> [B, H, D]."""
    attend = generic("attend")
    kv_len = int(pos.max()) + 1
    out = attend(q[:, None], pos[:, None], slots, kv_len, k_cache, v_cache, layer, window or None, scale,
                 q.shape[1] != k_cache.shape[2], softcap=softcap)  # [B, 1, H, D]
    return out[:, 0]


def generic(helper: str):
    """The generated module's helper `helper` (attend, rms_norm, apply_rope, write_cache, argmax, silu), as every
    emitted step has it: what each kernel standing in for it must compute."""
    return _prelude()[helper]


@functools.lru_cache(maxsize=None)
def _prelude() -> dict:
    namespace: dict = {}
    exec(PRELUDE, namespace)
    return namespace


def _small_ops_disagree(ext) -> str | None:
    """Which of the step's small-op kernels computes otherwise than its helper, or None: rope, the
    cache write and argmax exactly, RMSNorm within a float32 rounding of its sum (another summation
    order), silu and silu_mul within a 16-bit rounding (the exponential is a polynomial, ATen's
    Sleef's), the attention block exactly as its helper over the unfused kernels."""
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
                                          caches[2], caches[3], 1, None, 0.2, True, small)
        if not (torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])):
            return "attention block"
        logits = torch.randn(3, 50, generator=g).to(dtype)
        logits[1, 7] = logits[1, 30] = logits[1].max() + 1  # a tie: the first
        logits[2, 9] = float("nan")
        if not torch.equal(ext.argmax(logits), generic("argmax")(logits)):
            return "argmax"
    return None


def self_check(ext) -> str | None:
    """Why the built kernels cannot be trusted, or None: each against the generic ops on small cases."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=g).to(torch.bfloat16)
    for rows in (1, 2, 5, 9):  # one pass over w, and a second for the ninth row
        x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        got = ext.gemv_bf16(x, w)
        if not torch.allclose(got.float(), F.linear(x, w).float(), atol=5e-2, rtol=2e-2):
            return "its GEMV disagreed with F.linear"
        if not all(torch.equal(got[r], ext.gemv_bf16(x[r:r + 1], w)[0]) for r in range(rows)):
            return "its GEMV gave a row other numbers beside other rows than alone"
    wide = torch.randn(12, 2592, generator=g).to(torch.bfloat16)  # 5 rows of x overflow L1: K in chunks
    x = torch.randn(5, 2592, generator=g).to(torch.bfloat16)
    if not all(torch.equal(ext.gemv_bf16(x, wide)[r], ext.gemv_bf16(x[r:r + 1], wide)[0]) for r in range(5)):
        return "its GEMV's chunks over K gave a row other numbers than one pass"
    wh = torch.randn(50, 80, generator=g).half()  # K % 32 == 16: the GEMV's last step; 50 % 6: a short tile
    for rows in (1, 2, 7):
        xh = torch.randn(rows, 80, generator=g).half()
        want = F.linear(xh.float(), wh.float())
        if not torch.allclose(ext.row_linear(xh, wh).float(), want, atol=5e-2, rtol=5e-3):
            return "its float16 linear disagreed with F.linear"
        if not torch.allclose(ext.packed_float_linear(xh, ext.repack_rows8_float(wh), 50).float(), want, atol=5e-2, rtol=5e-3):
            return "its packed float16 linear disagreed with F.linear"
    wb = wh.to(torch.bfloat16)  # bf16 widened: the packed layout and the row layout's prompt tiles
    for rows in (1, 2, 7, 20):
        xb = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
        want = F.linear(xb.float(), wb.float())
        if not torch.allclose(ext.packed_float_linear(xb, ext.repack_rows8_float(wb), 50).float(), want, atol=0.1, rtol=2e-2):
            return "its packed bfloat16 linear disagreed with F.linear"
        if rows > 2 and not torch.allclose(ext.gemm_bf16(xb, wb).float(), want, atol=0.1, rtol=2e-2):
            return "its bfloat16 prompt tiles disagreed with F.linear"
    wb, xb = torch.randn(40, 96, generator=g).to(torch.bfloat16), torch.randn(45, 96, generator=g).to(torch.bfloat16)
    got = ext.packed_float_linear(xb, ext.repack_rows8_float(wb), 40)  # a prompt: AMX's tiles where the level has them
    if not torch.allclose(got.float(), F.linear(xb.float(), wb.float()), atol=0.1, rtol=2e-2):
        return "its packed bfloat16 prompt disagreed with F.linear"
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
