"""Linnet's CPU kernels (backends/cpu/csrc/*.cpp) against the generic ops, and where sessions use them, at
the level this CPU runs; `test_every_lower_level_passes_these_tests` runs them again at each lower level."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from linnet_core.backends.cpu import build, extension, selfcheck
from linnet_core.backends.cpu.linears import DecodeLinear, active, linear_kernel, pack_linear_weights
from linnet_core.backends.torch_backend import session_weights


@pytest.fixture(scope="module")
def ext():
    built = extension.extension()
    if built is None:
        pytest.skip(f"the CPU decode kernels do not run here: {extension.why_not()}")
    return built


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("out_features", [8, 83, 640])  # whole passes of 8 rows, a ragged tail, many tasks
@pytest.mark.parametrize("in_features", [32, 96, 2560])
def test_gemv_matches_f_linear(ext, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(1, rows, in_features, generator=g).to(torch.bfloat16)  # [B, T, K] as a step has it
    got = extension.decode_linear(x, w)
    assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float())  # float32 accumulation both ways: only the last rounding differs
    assert torch.allclose(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


def test_bias_and_what_the_kernel_leaves_to_f_linear(ext):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    for x in (torch.randn(1, 1, 64, generator=g), torch.randn(1, 5, 64, generator=g),  # prefill rows
              torch.randn(1, 1, 64, generator=g)[..., ::2].repeat(1, 1, 2)):  # non-contiguous view made whole
        x = x.to(torch.bfloat16)
        want = F.linear(x.float(), w.float(), b.float())
        assert torch.allclose(extension.decode_linear(x, w, b).float(), want, atol=0.1, rtol=2e-2)
    odd = torch.randn(24, 48, generator=g).to(torch.bfloat16)  # in_features not a multiple of 32
    x = torch.randn(1, 1, 48, generator=g).to(torch.bfloat16)
    assert torch.equal(extension.decode_linear(x, odd), F.linear(x, odd))


def test_each_dtype_takes_linnets_kernel(ext):
    from linnet_core.backends.cpu.linears import PackedFloatLinear

    # bf16 stays mapped where the ISA's bf16 dot spans one row or the CPU has AMX this build lacks (oneDNN's
    # prompts); elsewhere it is repacked: pair dots where they span two rows, else widened as float16
    amx_unused = "amx_bf16" in build.cpu_features() and not ext.amx()
    mapped = ext.bf16_dot() and (not ext.packed_bf16_dot() or amx_unused)
    assert linear_kernel(torch.bfloat16) is (DecodeLinear if mapped else PackedFloatLinear)
    assert ext.packed_bf16_dot() == (ext.level() in ("avx512-amx", "avx512"))
    assert ext.amx() == (ext.level() == "avx512-amx")  # Linux grants the tiles wherever the CPU has them
    assert linear_kernel(torch.float16) is PackedFloatLinear and linear_kernel(torch.float32) is PackedFloatLinear
    assert ext.bf16_dot() == (ext.level() in ("avx512-amx", "avx512", "neon-i8mm", "neon-dotprod-bf16"))


@pytest.mark.parametrize("M", [13, 32, 45, 128])
def test_bfloat16_prompts_on_the_packed_blocks_match_f_linear(ext, M):
    """A prompt's bf16 rows over the packed blocks (AMX's tiles where the level has them, else the pair-dot or
    widening tiles): within bf16's rounding of float32's product, each row as it is alone, and rows past
    the packed blocks' padding (N % 32) and token rows past a tile (M % 32) left out."""
    g = torch.Generator().manual_seed(M)
    for N, K in ((50, 96), (1000, 1024), (72, 3072)):
        w, x = torch.randn(N, K, generator=g).bfloat16(), torch.randn(M, K, generator=g).bfloat16()
        packed = ext.repack_rows8_float(w)
        got = ext.packed_float_linear(x, packed, N)
        want = F.linear(x.float(), w.float())
        assert got.shape == (M, N) and torch.allclose(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)
        assert (got == want.bfloat16()).float().mean() > 0.99  # most sums round as float32's do
        assert torch.equal(ext.packed_float_linear(x[:1].expand(M, K).contiguous(), packed, N)[0], got[0])


@pytest.mark.parametrize("rows", [1, 2])
def test_float32_gemvs_match_f_linear(ext, rows):
    """float32 decode rows: the row kernel (a tied head) and the packed one, within float32's rounding."""
    g = torch.Generator().manual_seed(rows)
    for N, K in ((83, 32), (700, 48), (640, 2560)):
        w, x = torch.randn(N, K, generator=g), torch.randn(rows, K, generator=g)
        want = F.linear(x.double(), w.double()).float()
        assert torch.allclose(ext.gemv_f32(x, w), want, atol=1e-4, rtol=1e-4)
        assert torch.allclose(ext.packed_float_linear(x, ext.repack_rows8_float(w), N), want, atol=1e-4, rtol=1e-4)
        assert torch.equal(ext.row_linear(x, w), ext.gemv_f32(x, w))


ATTENTION_SHAPES = [  # (rows, heads, kv heads, head size, window)
    (1, 32, 8, 128, 0),  # Qwen3-4B's decode
    (3, 4, 2, 64, 0),  # several rows
    (2, 6, 6, 32, 5),  # no grouping, a sliding window
    (2, 8, 1, 96, 3),  # one kv head
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_matches_sdpa(ext, dtype, shape):
    B, H, KV, D, window = shape
    g = torch.Generator().manual_seed(B * H + D)
    k = torch.randn(3, 4, KV, 40, D, generator=g).to(dtype)  # [L, rows, KV, S, D]
    v = torch.randn(3, 4, KV, 40, D, generator=g).to(dtype)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    slots = torch.randperm(4, generator=g)[:B]
    pos = torch.tensor([39, 0, 17][:B])  # the cache's last position, the first, one between
    got = ext.decode_attention(q, k, v, 1, slots, pos, window, D ** -0.5)
    want = selfcheck.reference_attention(q, k, v, 1, slots, pos, window, D ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # one rounding of the output
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    # Gemma 2's soft-capped scores (a cap that bends them: scaled scores reach ~3 here)
    got = ext.decode_attention(q, k, v, 1, slots, pos, window, 4 * D ** -0.5, 1.5)
    want = selfcheck.reference_attention(q, k, v, 1, slots, pos, window, 4 * D ** -0.5, softcap=1.5)
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert not torch.allclose(got.float(), ext.decode_attention(q, k, v, 1, slots, pos, window, 4 * D ** -0.5).float(),
                              atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", ATTENTION_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_over_a_float16_cache_widens_it_as_the_lines_do(ext, shape):
    """float32 queries over the float16 cache that quantized weights keep: what the generic lines
    compute after `.to(q.dtype)` of the keys and values, within float32's rounding."""
    B, H, KV, D, window = shape
    g = torch.Generator().manual_seed(B + H + D)
    k, v = (torch.randn(3, 4, KV, 40, D, generator=g).half() for _ in range(2))
    q = torch.randn(B, H, D, generator=g)
    slots, pos = torch.randperm(4, generator=g)[:B], torch.tensor([39, 0, 17][:B])
    got = ext.decode_attention(q, k, v, 1, slots, pos, window, D ** -0.5)
    want = selfcheck.reference_attention(q, k, v, 1, slots, pos, window, D ** -0.5)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="one dtype"):  # float16 queries over a float32 cache: no
        ext.decode_attention(q.half(), k.float(), v.float(), 1, slots, pos, window, 1.0)


def test_float32_keys_go_into_a_float16_cache_as_to_rounds_them(ext):
    g = torch.Generator().manual_seed(8)
    k, v = (torch.randn(1, 3, 2, 32, generator=g) * 300 for _ in range(2))  # some beyond float16's 11 bits
    pos, rows = torch.tensor([[4, 9, 0]]), torch.tensor([[1, 0, 1]])
    caches = [torch.randn(2, 2, 2, 16, 32, generator=g).half() for _ in range(2)]
    mine = [c.clone() for c in caches]
    selfcheck.generic("write_cache")(k, v, pos, rows, *caches, 1)
    ext.write_cache(k, v, pos, rows, *mine, 1)
    assert torch.equal(caches[0], mine[0]) and torch.equal(caches[1], mine[1])
    assert torch.equal(mine[0][1, 0, :, 9], k[0, 1].half())


def test_decode_attention_refuses_what_it_cannot_index(ext):
    k = torch.zeros(2, 3, 2, 8, 16)
    q = torch.zeros(1, 4, 16)
    for slots, pos in ((torch.tensor([3]), torch.tensor([0])), (torch.tensor([0]), torch.tensor([8])),
                       (torch.tensor([-1]), torch.tensor([0]))):
        with pytest.raises(RuntimeError, match="out of range"):
            ext.decode_attention(q, k, k, 1, slots, pos, 0, 1.0)
    with pytest.raises(RuntimeError):  # a layer past the cache
        ext.decode_attention(q, k, k, 2, torch.tensor([0]), torch.tensor([0]), 0, 1.0)


SMALL_OP_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", SMALL_OP_DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])  # decode, a prompt chunk
def test_step_kernels_compute_what_the_generated_helpers_do(ext, dtype, tokens):
    """RMSNorm, rope and the cache write on the views a step hands them (heads split from one fused
    projection): rope and the write exactly, RMSNorm within one rounding of its float32 sum."""
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(1, tokens, 16 * 128 + 2 * 8 * 128, generator=g).to(dtype)
    q, k, v = (t.reshape(1, tokens, -1, 128) for t in qkv.split([16 * 128, 8 * 128, 8 * 128], dim=-1))
    for x, w in ((q, torch.randn(128, generator=g)), (qkv, torch.randn(qkv.shape[-1], generator=g))):
        want, got = selfcheck.generic("rms_norm")(x, w.to(dtype), 1e-6), ext.rms_norm(x, w.to(dtype), 1e-6)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        ulp = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        assert torch.allclose(got.float(), want.float(), rtol=2 * ulp, atol=1e-6)
        assert (got != want).float().mean() < (0.6 if dtype == torch.float32 else 0.01)  # ulps, rarely at 16 bits
    pos = torch.arange(tokens)[None] + 40
    for rot in (128, 64):  # whole and partial rotary
        cos, sin = selfcheck.generic("rope_table")(pos, torch.rand(rot // 2, generator=g), dtype)
        assert torch.equal(ext.rope(q, cos, sin), selfcheck.generic("apply_rope")(q, cos, sin))
    caches = [torch.randn(2, 3, 8, 64, 128, generator=g).to(dtype) for _ in range(2)]  # [L, rows, KV, S, D]
    mine = [c.clone() for c in caches]
    rows = torch.randint(0, 3, (1, tokens), generator=g)
    selfcheck.generic("write_cache")(k, v, pos, rows, *caches, 1)
    ext.write_cache(k, v, pos, rows, *mine, 1)
    assert torch.equal(caches[0], mine[0]) and torch.equal(caches[1], mine[1])


@pytest.mark.parametrize("dtype", SMALL_OP_DTYPES)
def test_argmax_picks_as_aten_does(ext, dtype):
    """The first index of the largest, on ties too, and the first NaN where there is one."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 32000, generator=g).to(dtype)
    logits[1, 100] = logits[1, 20000] = 50.0
    logits[2, 31999] = float("nan")
    logits[3] = -float("inf")
    assert torch.equal(ext.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(ext.argmax(logits[:, None, 5:]), logits[:, None, 5:].argmax(dim=-1))  # a view, 3-d


@pytest.mark.parametrize("dtype", SMALL_OP_DTYPES)
def test_silu_computes_as_aten_does(ext, dtype):
    """16-bit: F.silu's values (float32 inside, one rounding) over the gate half of a fused row read in
    place, a ragged tail and the edges (overflow, underflow, infinities, NaN); float32: F.silu itself."""
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(2, 3, 2 * 1000 + 2, generator=g) * 6).to(dtype)
    gate = gate_up[..., :1001]  # 1001 % 16 != 0: the scalar tail too
    edges = torch.tensor([-1e4, -200.0, -88.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 88.0, 1e4,
                          float("inf"), -float("inf"), float("nan")] * 2).to(dtype)
    for x in (gate, edges):
        got = ext.silu(x)
        torch.testing.assert_close(got, F.silu(x), rtol=0, atol=0, equal_nan=True)
        assert got.is_contiguous()


def test_step_kernels_take_the_generic_ops_where_they_do_not_apply(ext):
    """A weight in another dtype, float64, strided caches: the helpers' ATen ops; a position past the
    cache is an error, as the indexed write's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16), torch.randn(64, generator=g)
    assert torch.equal(ext.rms_norm(x, w, 1e-5), selfcheck.generic("rms_norm")(x, w, 1e-5))
    x64 = torch.randn(1, 2, 4, 32, generator=g, dtype=torch.float64)
    cos, sin = selfcheck.generic("rope_table")(torch.tensor([[3, 4]]), torch.rand(16, generator=g), torch.float64)
    assert torch.equal(ext.rope(x64, cos, sin), selfcheck.generic("apply_rope")(x64, cos, sin))
    k = torch.randn(1, 2, 4, 32, generator=g)
    caches = [torch.zeros(1, 2, 4, 32, 8).transpose(-1, -2) for _ in range(4)]  # [L, rows, KV, S, D], strided
    pos, rows = torch.tensor([[5, 6]]), torch.tensor([[1, 1]])
    selfcheck.generic("write_cache")(k, k, pos, rows, caches[0], caches[1], 0)
    ext.write_cache(k, k, pos, rows, caches[2], caches[3], 0)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    caches = [c.contiguous() for c in caches]
    with pytest.raises(RuntimeError, match="out of range"):
        ext.write_cache(k, k, torch.tensor([[5, 8]]), rows, caches[2], caches[3], 0)


@pytest.mark.parametrize("backend,dtype", [("torch", "float32"), ("inductor", "float32"), ("torch", "q8_0"),
                                           ("inductor", "q4_0")])
def test_sessions_decode_with_the_step_kernels_as_without(ext, checkpoints, backend, dtype, monkeypatch):
    """A CPU session hands its step the kernels (inductor: the attention; eager: the small ops too);
    decode past a sliding window, in a second cache row, gives the logits of a session on the generic path
    (quantized weights: over a float16 cache, float32 activations)."""
    from linnet_core.backends import torch_backend
    from linnet_core.compile import load_model

    def decode_logits(session) -> torch.Tensor:  # [steps, V]
        tok, got = session.prefill([5, 9, 2, 7], slot=1).tokens[0], []
        for step in range(12):  # past the window of 8
            out = session.decode([tok], [4 + step], [1], logits=True)
            tok = out.tokens[0]
            got.append(torch.from_numpy(out.logits[0, -1]))
        return torch.stack(got)

    fused, _ = load_model(checkpoints["mistral-window"], backend, dtype, 32, rows=2, device="cpu")
    assert fused.k_cache.dtype == (torch.float16 if dtype.startswith("q") else torch.float32)
    kernels = fused.weights["global"]["step_kernels"]
    assert kernels.decode_attention is not None and (kernels.rms_norm is not None) == (backend == "torch")
    monkeypatch.setattr(torch_backend, "add_step_kernels", lambda *a: None)  # both backends' cpu_weights
    generic, _ = load_model(checkpoints["mistral-window"], backend, dtype, 32, rows=2, device="cpu")
    assert "step_kernels" not in generic.weights["global"]
    assert torch.allclose(decode_logits(fused), decode_logits(generic), atol=1e-4, rtol=1e-4)


def test_turned_off_or_unbuildable_means_onednn_not_an_error():
    code = ("from linnet_core.backends.cpu import extension, linears; import torch; "
            "print(extension.extension() is None, extension.why_not(), "
            "getattr(linears.linear_kernel(torch.bfloat16), '__name__', 'None'))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LINNET_DECODE_KERNELS": "0"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True" and "LINNET_DECODE_KERNELS=0" in " ".join(out)
    assert out[-1] in ("PackedLinear", "None")


def test_a_built_extension_loads_without_the_builder(ext):
    """Every later process imports the built module directly: torch's builder costs ~0.1 s of
    imports and a ninja run, a tenth of a warm load."""
    code = ("import sys; from linnet_core.backends.cpu import extension as k; "
            "print(k.extension() is not None, 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def fresh_machine_env(kernels) -> dict:
    """A first session on a new machine: an empty kernels folder, and only the system's PATH (the
    ninja wheel's folder is added by the builder, not by an activated venv)."""
    return {**os.environ, "LINNET_KERNELS": str(kernels),
            "PATH": os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix))}


@pytest.mark.slow
def test_a_fresh_machine_builds_the_kernel(ext, tmp_path):
    """What a first session does on a new machine: build into an empty folder (~100 s). Where this
    CPU runs a lower level, the lower-level test below builds that one so, and this one is left out."""
    if len(build.runnable_levels()) > 1 and not os.environ.get(build.LEVEL_ENV):
        pytest.skip("test_every_lower_level_passes_these_tests builds a level on a fresh machine")
    code = "from linnet_core.backends.cpu import extension as k; print(k.extension() is not None, k.why_not())"
    out = subprocess.run([sys.executable, "-c", code], env=fresh_machine_env(tmp_path / "kernels"),
                         capture_output=True, text=True, check=True)
    assert out.stdout.startswith("True"), out.stdout + out.stderr
    assert list((tmp_path / "kernels").glob("decode_kernels-*/*.so"))


def test_compiled_steps_reach_the_kernels_through_cpp_operators(ext):
    """torch.ops.linnet_kernels.* take a handle into the session made active in this thread: each
    session's own weights, exactly the eager kernels' results, and a clear error outside one."""
    from linnet_core.backends.cpu.linears import Kernels, QuantLinear, QuantTable, active
    from linnet_core.quant import dequantize, quantize

    g = torch.Generator().manual_seed(4)
    blocks = [quantize(torch.randn(40, 64, generator=g), "q4_0") for _ in range(2)]
    sessions = [Kernels([QuantLinear(b, 0, "q4_0"), QuantTable(b, 1, "q4_0")]) for b in blocks]
    x, ids = torch.randn(3, 64, generator=g), torch.tensor([[0, 39, 7]])
    for kernels, b in zip(sessions, blocks):
        with active(kernels):
            assert torch.equal(torch.ops.linnet_kernels.linear(x, 0, 40), kernels[0].eager(x, None))
            assert torch.equal(torch.ops.linnet_kernels.embedding(ids, 1, 64), dequantize(b, "q4_0")[ids])
            with pytest.raises(RuntimeError, match="no session's kernel 1"):
                torch.ops.linnet_kernels.linear(x, 1, 40)  # a table is no linear
    with pytest.raises(RuntimeError, match="no session's kernel 0"):
        torch.ops.linnet_kernels.linear(x, 0, 40)  # none active in this thread now


def test_float16_linears_run_decode_by_the_gemv_and_prompts_by_the_tiled_gemm(ext):
    """Decode rows by Linnet's GEMV, prompts by its tiled GEMM (float32 inside, rounded once: within
    half an ulp of float16 of the float32 product), every tile shape at the edges."""
    from linnet_core.backends.cpu.linears import RowLinear

    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(700, 64, generator=g).half(), torch.randn(700, generator=g).half()
    for K in (48, 64):  # K % 32 == 16 takes the GEMV's single last step
        for rows in (1, 2):
            x = torch.randn(rows, 1, K, generator=g).half()
            want = F.linear(x.float(), w[:, :K].float())
            got = ext.gemv_f16(x, w[:, :K].contiguous())
            assert got.dtype == torch.float16 and got.shape == (rows, 1, 700)
            assert torch.allclose(got.float(), want, atol=2e-3, rtol=1e-3)  # float16's half-ulp is 2**-11
            assert torch.equal(ext.row_linear(x, w[:, :K].contiguous()), got)
    odd = torch.randn(1, 40, generator=g).half()  # K % 16 != 0: PyTorch's kernel, as it computes
    assert torch.equal(ext.row_linear(odd, w[:, :40].contiguous()), F.linear(odd, w[:, :40]))
    one = torch.randn(1, 1, 64, generator=g).half()
    assert torch.equal(RowLinear(w, 0).eager(one, b), ext.gemv_f16(one, w) + b)
    for tokens in range(3, 10):  # token rows past the GEMV: whole and short tiles of 4; 700 % 6 == 4
        prompt = torch.randn(1, tokens, 64, generator=g).half()
        got = RowLinear(w, 0).eager(prompt, None)
        assert got.dtype == torch.float16 and got.shape == (1, tokens, 700)
        assert torch.equal(got, ext.gemm_f16(prompt, w))
        assert torch.allclose(got.float(), F.linear(prompt.float(), w.float()), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("slices", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_packed_float_linears_match_the_product(ext, dtype, slices, monkeypatch):
    """Weights repacked in blocks of 4 rows interleaved (decode takes 8 at once) compute the float32 product, rounded once to the dtype
    (a 16-bit type's half ulp; float32's own summation order), decode rows and prompts, at every tile edge
    (rows past a block of 8, token rows past a tile of 2 or 6; K over several of the prompt's slices, tokens
    past a group of tiles), with float32 prompts through K in slices and whole (the L1's size picks one)."""
    from linnet_core.backends.cpu.linears import PackedFloatLinear

    monkeypatch.setenv("LINNET_PROMPT_SLICES", slices)

    g = torch.Generator().manual_seed(7)
    tol = {torch.float16: dict(atol=2e-3, rtol=1e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=8e-3),
           torch.float32: dict(atol=1e-4, rtol=1e-4)}[dtype]
    for N, K in ((45, 32), (700, 64), (8, 48), (24, 2080)):
        w, b = torch.randn(N, K, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
        packed = ext.repack_rows8_float(w)
        assert packed.shape == ((N + 7) // 8 * 2, K // 16, 4, 16) and packed.dtype == dtype
        kernel = PackedFloatLinear(w, 0)
        for rows in (1, 2):
            x = torch.randn(rows, 1, K, generator=g).to(dtype)
            got = ext.packed_float_linear(x, packed, N)
            assert got.dtype == dtype and got.shape == (rows, 1, N)
            assert torch.allclose(got.float(), F.linear(x.double(), w.double()).float(), **tol)
            assert torch.equal(kernel.eager(x, b), got + b)
        for tokens in [*range(3, 14), 53]:
            prompt = torch.randn(1, tokens, K, generator=g).to(dtype)
            got = ext.packed_float_linear(prompt, packed, N)
            assert got.dtype == dtype and got.shape == (1, tokens, N)
            assert torch.allclose(got.float(), F.linear(prompt.double(), w.double()).float(), **tol)
            # the prompt tiles' rows are the decode pass's: a speculative check's rows are decode's
            assert torch.equal(got[0, :2], ext.packed_float_linear(prompt[0, :2], packed, N))
            assert torch.equal(got[0, -1:], ext.packed_float_linear(prompt[0, -1:], packed, N))
    with pytest.raises(RuntimeError, match="blocks of another shape"):
        ext.packed_float_linear(torch.randn(1, 32).half(), ext.repack_rows8_float(torch.randn(16, 32).half()), 24)
    with pytest.raises(RuntimeError, match="K % 16 == 0"):
        ext.repack_rows8_float(torch.randn(8, 40).half())


def test_bf16_prompts_take_the_widening_tiles_where_the_isa_has_no_bf16_dot(ext):
    """A bf16 prompt over a weight in its row layout: the register tiles (float32 inside, rounded once)
    where the ISA has no bf16 dot product (oneDNN's bf16 GEMM there ran ~6x llama.cpp's prompt time),
    F.linear where it has one; a tied bf16 head (RowLinear) goes the same way."""
    from linnet_core.backends.cpu.linears import RowLinear

    g = torch.Generator().manual_seed(9)
    w = torch.randn(700, 64, generator=g).to(torch.bfloat16)
    for tokens in (17, 18, 19, 40):  # past the GEMV's 16 rows: whole and short tiles
        prompt = torch.randn(1, tokens, 64, generator=g).to(torch.bfloat16)
        tiles = ext.gemm_bf16(prompt, w)
        assert tiles.dtype == torch.bfloat16 and tiles.shape == (1, tokens, 700)
        assert torch.allclose(tiles.float(), F.linear(prompt.double(), w.double()).float(), atol=1.6e-2, rtol=8e-3)
        want = F.linear(prompt, w) if ext.bf16_dot() else tiles
        assert torch.equal(ext.bf16_linear(prompt, w), want)
        assert torch.equal(RowLinear(w, 0).eager(prompt, None), want)
    one = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(RowLinear(w, 0).eager(one, None), ext.gemv_bf16(one, w))
    with pytest.raises(RuntimeError, match="bfloat16 x and w"):
        ext.gemm_bf16(one.half(), w)


def test_float16_heads_tied_to_the_token_table_keep_their_layout(ext):
    """A float16 linear is repacked (its mapped original released); a head that is the token table
    keeps the table's layout, which the step's gathers read."""
    from linnet_core.backends.cpu.linears import RowLinear, PackedFloatLinear

    g = torch.Generator().manual_seed(8)
    table, proj = torch.randn(40, 32, generator=g).half(), torch.randn(24, 32, generator=g).half()
    released = []

    class Mapped(dict):
        def release(self, name):
            released.append(name)

    weights = Mapped({"global": {"token_embd.weight": table, "output.weight": table},
                      "layers": [{"attn_qkv.weight": proj}]})
    kernels = pack_linear_weights(weights, {"global": ["output.weight"], "block": ["attn_qkv.weight"]})
    assert isinstance(weights["global"]["output.weight"], RowLinear)
    assert weights["global"]["token_embd.weight"] is table
    assert isinstance(weights["layers"][0]["attn_qkv.weight"], PackedFloatLinear)
    assert released == ["blk.0.attn_qkv.weight"] and len(kernels) == 2


@pytest.mark.parametrize("dtype", SMALL_OP_DTYPES)
def test_fused_step_kernels_compute_what_their_helpers_do(ext, dtype):
    """silu_mul and add_rms_norm exactly as the helpers' lines over the single kernels (silu at 16
    bits, F.silu for float32); the attention block of three one-token rows (q/k norms, partial rotary,
    a sliding window) exactly as its helper over the unfused kernels, caches included (float32's in
    float16, as quantized weights keep it)."""
    from linnet_core.backends.cpu.step_kernels import DecodeAttention, StepKernels

    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(1, 3, 2 * 1001 + 6, generator=g).to(dtype)[..., :2002]  # rows at a stride, a tail
    single = StepKernels(silu=ext.silu if dtype != torch.float32 else None)
    assert torch.equal(ext.silu_mul(gate_up), selfcheck.generic("silu_mul")(gate_up, single))
    x, y, w = (torch.randn(1, 3, 96, generator=g).to(dtype) for _ in range(3))
    total, normed = ext.add_rms_norm(x, y, w[0, 0], 1e-5)
    assert torch.equal(total, x + y) and torch.equal(normed, ext.rms_norm(x + y, w[0, 0], 1e-5))

    heads, kv_heads, D = 8, 2, 32
    qkv = torch.randn(1, 3, (heads + 2 * kv_heads) * D + 16, generator=g).to(dtype)[..., 16:]  # a view
    q_norm, k_norm = (torch.randn(D, generator=g).to(dtype) for _ in range(2))
    pos, rows = torch.tensor([[9, 0, 30]]), torch.tensor([[2, 0, 1]])
    cos, sin = selfcheck.generic("rope_table")(pos, torch.rand(8, generator=g), dtype)  # rotary 16 of 32
    cache_dtype = torch.float16 if dtype == torch.float32 else dtype  # float32 beside the quantized formats' cache
    caches = [torch.randn(2, 3, kv_heads, 40, D, generator=g).to(cache_dtype) for _ in range(2)]  # [L, rows, KV, S, D]
    mine = [c.clone() for c in caches]
    unfused = StepKernels(decode_attention=DecodeAttention(ext), rms_norm=ext.rms_norm, rope=ext.rope,
                          write_cache=ext.write_cache)
    for norms, window in (((q_norm, k_norm), 8), ((None, None), None)):
        want = selfcheck.generic("attention_block")(
            qkv, heads, kv_heads, D, *norms, 1e-6, cos, sin, pos, rows, rows[0], None, torch.zeros(0, dtype=torch.long),
            None, None, None, *caches, 1, window, 0.17, True, unfused)
        got = ext.attention_block(qkv, heads, kv_heads, *norms, 1e-6, cos, sin, pos, rows, *mine, 1, window or 0, 0.17)
        assert got.shape == (1, 3, heads * D) and torch.equal(got, want)
        assert torch.equal(caches[0], mine[0]) and torch.equal(caches[1], mine[1])
    # A NoPE layer's block runs the kernel with cos 1 and sin 0, which must leave q and k as they are.
    heads_x = qkv[..., :heads * D].reshape(1, 3, heads, D)
    assert torch.equal(ext.rope(heads_x, torch.ones_like(cos), torch.zeros_like(sin)), heads_x)


def test_the_attention_block_leaves_prompt_chunks_to_the_lines(ext):
    """A step with a prompt chunk takes the helper's own lines (the kernel attends one-token rows only)."""
    from linnet_core.backends.cpu.step_kernels import StepKernels

    def refuse(*a):
        raise AssertionError("the fused kernel was called for a prompt chunk")

    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(1, 4, 4 * 16, generator=g)
    pos, rows = torch.arange(4)[None], torch.zeros(1, 4, dtype=torch.long)
    cos, sin = selfcheck.generic("rope_table")(pos, torch.rand(8, generator=g), torch.float32)
    caches = [torch.zeros(1, 1, 1, 8, 16) for _ in range(2)]
    index = (torch.zeros(0, dtype=torch.long), 1, torch.tensor([0]), torch.arange(4)[None], torch.arange(4), 4)
    helper = selfcheck.generic("attention_block")
    got = helper(qkv, 2, 1, 16, None, None, None, cos, sin, pos, rows, *index, *caches, 0, None, 0.25, True,
                 StepKernels(attention_block=refuse))
    want = helper(qkv, 2, 1, 16, None, None, None, cos, sin, pos, rows, *index,
                  *[torch.zeros(1, 1, 1, 8, 16) for _ in range(2)], 0, None, 0.25, True, None)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sessions_decode_with_the_fused_kernels_exactly_as_with_the_single_ones(ext, checkpoints, dtype):
    """Every family fixture, three rows decoding together past a sliding window: the same logits and
    caches, bit for bit, with the fused calls as with the single kernels they replace."""
    import dataclasses

    from family_fixtures import FAMILY_CASES
    from linnet_core.compile import load_model

    for case in FAMILY_CASES:
        session, _ = load_model(checkpoints[case], "torch", dtype, 32, rows=3, device="cpu")
        fused = session.weights["global"]["step_kernels"]
        assert None not in (fused.attention_block, fused.silu_mul, fused.add_rms_norm)
        runs = []
        for kernels in (fused, dataclasses.replace(fused, attention_block=None, silu_mul=None, add_rms_norm=None)):
            session.weights["global"]["step_kernels"] = kernels
            session.k_cache.zero_(), session.v_cache.zero_()
            toks = [session.prefill([1 + j, 5, 7, 9, 11 + j], slot=j).tokens[0] for j in range(3)]
            logits = []
            for step in range(12):
                out = session.decode(toks, [5 + step] * 3, [0, 1, 2], logits=True)
                toks = list(out.tokens)
                logits.append(torch.from_numpy(out.logits.copy()))
            runs.append((torch.stack(logits), session.k_cache.clone(), session.v_cache.clone()))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), case


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_fresh_one_kept(tmp_path):
    """torch's builder waits on its lock file for as long as it exists: one older than any build is
    removed (with a notice), a recent one (a build still running) is left to the builder."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not build.clear_stale_lock(tmp_path) and lock.exists()
    old = os.path.getmtime(lock) - build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(build.KernelBuildNotice, match="stale build lock"):
        assert build.clear_stale_lock(tmp_path)
    assert not lock.exists() and not build.clear_stale_lock(tmp_path)


def test_dispatch_takes_the_highest_level_the_cpu_runs(monkeypatch):
    """As ATen and ggml dispatch: the first level whose features this CPU has (x86-64 from
    /proc/cpuinfo's flags, ARM64 from HWCAP), none below the floor, each level's flags in its key."""
    monkeypatch.delenv(build.LEVEL_ENV, raising=False)
    avx512 = {"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    cases = [("x86_64", avx512 | {"amx_tile", "amx_bf16", "amx_int8"}, "avx512-amx"),
             ("x86_64", avx512 | {"amx_tile"}, "avx512"),  # AMX without its bf16 dot
             ("x86_64", avx512, "avx512"),
             ("x86_64", {"avx2", "fma", "f16c", "avx_vnni", "avx512f"}, "avx2-vnni"),  # AVX-512 without BF16
             ("x86_64", {"avx2", "fma", "f16c"}, "avx2"),
             ("x86_64", {"avx", "sse4_2"}, None),
             ("aarch64", {"asimd", "asimddp", "bf16", "i8mm"}, "neon-i8mm"),
             ("aarch64", {"asimd", "asimddp", "bf16"}, "neon-dotprod-bf16"),
             ("aarch64", {"asimd", "asimddp"}, "neon-dotprod"),
             ("aarch64", {"asimd"}, "neon")]
    for arch, features, want in cases:
        monkeypatch.setattr(build, "_arch", lambda arch=arch: arch)
        monkeypatch.setattr(build, "cpu_features", lambda features=features: frozenset(features))
        level = build.chosen_level()
        assert (level.name if level else None) == want, (arch, features)
        if want is None:
            assert "lacks AVX2, FMA and F16C" in build.unusable() and "q8_0/q4_0" in build.unusable()
    keys = {build._key(level) for level in build.LEVELS}
    assert len(keys) == len(build.LEVELS)  # one build folder per level


def test_a_forced_level_is_honoured_and_a_level_the_cpu_lacks_is_one_line(monkeypatch):
    monkeypatch.setattr(build, "_arch", lambda: "x86_64")
    monkeypatch.setattr(build, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    monkeypatch.setenv(build.LEVEL_ENV, "avx2")
    assert build.chosen_level().name == "avx2" and build.describe() == "AVX2 (avx2)"
    from linnet_core.errors import BackendUnavailable

    for name, says in (("avx512", "asks for AVX-512 BF16/VNNI, which this CPU lacks (it runs: avx2-vnni, avx2)"),
                       ("sse9", "is not a kernel level; the levels are avx512-amx, avx512, avx2-vnni, avx2, neon-i8mm, neon-dotprod-bf16")):
        monkeypatch.setenv(build.LEVEL_ENV, name)
        with pytest.raises(BackendUnavailable, match=says.replace("(", r"\(").replace(")", r"\)")) as e:
            build.chosen_level()
        assert "\n" not in str(e.value)
        assert build.status()[0] is False and says in build.status()[1]


def test_a_level_that_fails_to_build_gives_way_to_the_next(monkeypatch):
    """A compiler too old for the highest level's flags (AMX's) builds the next level, said once; a forced
    level that fails to build is the generic ops with the reason, never another level."""
    from linnet_core.backends.cpu import extension as extension_module

    monkeypatch.setattr(build, "_arch", lambda: "x86_64")
    monkeypatch.setattr(build, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    monkeypatch.delenv(build.LEVEL_ENV, raising=False)

    class Built:
        def __init__(self, name):
            self.name = name

        def level(self):
            return self.name

    def fake_build(level):
        if level.name == "avx2-vnni":
            raise RuntimeError("g++: error: unrecognized command-line option '-mavxvnni'")
        return Built(level.name)

    monkeypatch.setattr(extension_module, "build_extension", fake_build)
    monkeypatch.setattr(extension_module, "self_check", lambda ext: None)
    monkeypatch.setattr(extension_module, "register_fakes", lambda: None)
    with pytest.warns(build.KernelBuildNotice, match=r"run at AVX2 \(avx2\): the build for avx2-vnni failed "
                                                      r"\(RuntimeError: g\+\+: error: unrecognized"):
        ext, why = extension_module._build_and_check()
    assert ext.level() == "avx2" and why is None
    monkeypatch.setenv(build.LEVEL_ENV, "avx2-vnni")
    ext, why = extension_module._build_and_check()
    assert ext is None and why == "they could not be built (RuntimeError: g++: error: unrecognized command-line option '-mavxvnni')"


def test_a_forced_level_the_cpu_lacks_stops_the_cli_in_one_line(tmp_path):
    """What a user sees: one line and a non-zero exit, not a quiet fallback to the generic ops."""
    missing = next((lv for lv in build.LEVELS if lv not in build.runnable_levels()), None)
    env = {**os.environ, build.LEVEL_ENV: missing.name, "LINNET_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "linnet_cli", "run", "--prompt", "hi", "--max-new-tokens", "2"],
                         env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"{build.LEVEL_ENV}={missing.name} asks for {missing.label}, which this CPU lacks" in out.stderr


# Inductor's tests stay at the top level only: they compile the same kernels' custom ops, and each
# C++ compile costs ~a minute a level on 2 cores (CI's budget).
LOWER_LEVEL_TESTS = ["tests/test_cpu_kernels.py", "tests/test_quantized.py", "-k",
                     "not lower_level and not fresh_machine and not inductor and (kernel or repacking or cpu_kernels)"]


@pytest.mark.slow
def test_every_lower_level_passes_these_tests(ext, tmp_path):
    """An AVX-512 machine runs the AVX2 builds too: each lower level this CPU runs is built (~2 min
    each; the first as on a fresh machine) and held to these tests and the quantized ones (both
    formats, every family fixture)."""
    if os.environ.get(build.LEVEL_ENV):
        pytest.skip("a run at a forced level: its own lower levels are the parent run's")
    lower = build.runnable_levels()[1:]
    if not lower:
        pytest.skip(f"{build.describe()} is this CPU's only level")
    for i, level in enumerate(lower):
        env = fresh_machine_env(tmp_path / "kernels") if i == 0 else dict(os.environ)
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *LOWER_LEVEL_TESTS],
                             env={**env, build.LEVEL_ENV: level.name}, capture_output=True, text=True)
        assert out.returncode == 0, f"{level.name}:\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
        assert " passed" in out.stdout and " failed" not in out.stdout
        if i == 0:
            assert list((tmp_path / "kernels").glob(f"decode_kernels-{level.name}-*/*.so"))


def test_a_session_without_cpu_kernels_activates_none():
    """A GPU session has no CPU kernels, and its compiled step enters `active` all the same (the
    first GPU pass of this code found inductor and CUDA graphs failing there with AttributeError)."""
    kernels = session_weights({"global": {}, "layers": []}, {"linear_weights": {"global": [], "block": []}},
                              "cuda", eager=False)
    assert kernels == [] and kernels.native_id == 0
    with active(kernels):
        pass


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "bfloat16", "float16", "float32"])
@pytest.mark.parametrize("tokens", [1, 7, 40])  # decode; a few rows (GEMVs in one pass); a prompt (per expert)
def test_experts_in_one_cpp_call_match_the_per_expert_lines(ext, fmt, tokens):
    """Each expert stack is packed one kernel per expert; the experts op is then one C++ call that
    runs just the chosen experts, and computes what the generated lines do over the same kernels
    (an expert no token chose is never run)."""
    from linnet_core.backends.cpu.linears import ExpertStack
    from linnet_core.backends.torch_emit import PRELUDE
    from linnet_core.dtypes import FORMATS, compute_dtype
    from linnet_core.ir.numpy_ops import route
    from linnet_core.quant import quantize

    E, width, hidden = 5, 64, 96
    g = torch.Generator().manual_seed(11)
    dtype = getattr(torch, compute_dtype(fmt))
    stacks = {"gate": torch.randn(E * width, hidden, generator=g), "up": torch.randn(E * width, hidden, generator=g),
              "down": torch.randn(E * hidden, width, generator=g)}
    quantized = FORMATS[fmt].quantized

    class Mapped(dict):
        def format_of(self, name):
            return fmt if quantized and not name.startswith("global") and "norm" not in name else None

    layer = {k: quantize(w, fmt) if quantized else w.to(dtype) for k, w in stacks.items()}
    weights = Mapped({"global": {"norm": torch.ones(hidden, dtype=dtype)}, "layers": [layer]})
    kernels = pack_linear_weights(weights, {"global": [], "block": list(stacks), "experts": dict.fromkeys(stacks, E)})
    assert all(isinstance(layer[k], ExpertStack) and len(layer[k]) == E for k in stacks) and len(kernels) == 3 * E
    logits = torch.randn(tokens, E, generator=g)
    logits[:, 3] = -30.0  # expert 3: chosen by no token
    expert_weights = torch.from_numpy(route(logits.numpy(), top_k=2, normalize=True)).to(dtype)
    x = torch.randn(1, tokens, hidden, generator=g).to(dtype)
    ns: dict = {}
    exec(PRELUDE, ns)
    with active(kernels):
        fused = layer["gate"].experts(x, expert_weights[None], layer["up"], layer["down"], "silu")
        lines = ns["experts"](x, expert_weights[None], list(layer["gate"]), list(layer["up"]), list(layer["down"]), 2,
                              "silu")  # plain lists: the per-expert lines
    assert fused is not None and fused.shape == x.shape and fused.dtype == dtype
    assert torch.allclose(fused.float(), lines.float(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-3)
