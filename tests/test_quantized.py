"""q8_0 / q4_0 weights: GGUF's blocks bit for bit, Linnet's CPU kernels against a float32 reference
over the same dequantized weights on every family, the same bytes in a GGUF export (and llama.cpp
computing on them), and one-line refusals where a backend has no kernels."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from family_fixtures import CASES, FAMILY_CASES, make_checkpoint, needs_kernels
from test_cli import assert_one_line_error, invoke

from linnet_core.backends.cpu import extension
from linnet_core.quant import dequantize, int8_blocks, param_formats, quantize, summary

FORMATS = ["q8_0", "q4_0"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_are_the_gguf_packages_bit_for_bit(fmt):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 128, generator=g) * torch.rand(70, 1, generator=g) * 4  # [rows, K]
    w[0, :32] = 0  # an all-zero block: scale 0
    w[1, 7], w[2, 40] = 1e4, -3e-6  # an outlier, a tiny value
    w[3, :32] = torch.linspace(-1, 1, 32)  # exact halves on the rounding boundary
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    ours = quantize(w, fmt, chunk=64 * 32)  # several chunks
    assert np.array_equal(ours.numpy(), gguf.quants.quantize(w.numpy(), qtype))
    assert np.array_equal(dequantize(ours, fmt).numpy(), gguf.quants.dequantize(ours.numpy(), qtype))


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 4, 6, 9, 40])
def test_kernel_is_a_float32_matmul_over_int8_activations_and_the_dequantized_weights(fmt, rows):
    g = torch.Generator().manual_seed(rows)
    blocks = quantize(torch.randn(301, 256, generator=g), fmt)  # 301 rows: a last group of 8 padded
    x, bias = torch.randn(rows, 256, generator=g) * 3, torch.randn(301, generator=g)
    got = extension.quant_linear(x, extension.repack(blocks, fmt), fmt, 301, bias)
    want = torch.nn.functional.linear(int8_blocks(x), dequantize(blocks, fmt), bias)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_repacking_moves_the_bytes_and_changes_none(fmt):
    """8 rows interleaved per block: every scale and quant byte kept (q8_0's with the sign bit
    flipped, 128 above its value), the padding rows zero."""
    blocks = quantize(torch.randn(13, 64, generator=torch.Generator().manual_seed(1)), fmt)  # [13, 2 * bb]
    packed = extension.repack(blocks, fmt)  # [2 groups, 2 blocks * 8 rows * bb]
    bb = blocks.shape[1] // 2
    assert packed.shape == (2, 2 * 8 * bb) and packed.dtype == torch.uint8
    if fmt == "q8_0":
        packed = packed.clone()
        packed.view(2, 2, 8 * bb)[:, :, 16:] ^= 0x80  # [group, block, quants after the 8 scales]
    assert sorted(packed.flatten().tolist()) == sorted(blocks.flatten().tolist() + [0] * (3 * 2 * bb))
    first = packed[0, :8 * bb]  # block 0 of rows 0..7: their scales, then 4-byte chunks row by row
    assert torch.equal(first[:16].view(8, 2), blocks[:8, :2])
    assert torch.equal(first[16:48].view(8, 4), blocks[:8, 2:6])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", FAMILY_CASES)
@pytest.mark.parametrize("backend", ["jax", "stablehlo"])
def test_xla_dequantizes_in_the_graph_exactly(backend, case, fmt, checkpoints, session_cache):
    """Integer weights in, float32 out inside the graph: the same numbers as the reference's."""
    pytest.importorskip("jax")
    from linnet_core.cache import ArtifactCache
    from linnet_core.check.verify import verify

    r = verify(checkpoints[case], backend, fmt, steps=6, cache_len=64, cache=ArtifactCache(session_cache))
    assert r.passed and r.tokens_match, r.to_json()
    assert r.activations == "float32" and r.distance <= r.tolerance < 0.01  # float32's tolerance


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", FAMILY_CASES)
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_cpu_kernels_compute_as_llama_cpp_does(backend, case, fmt, checkpoints, session_cache):
    """Linnet's kernels and MatMulNBits round the activations to int8 blocks, as llama.cpp does:
    held to that precision's tolerance against a reference that rounds them the same way. Most
    rows agree to float32's precision, but an activation within an ulp of a rounding boundary (a
    q4_0 table's rows land some on exact ties) can round to the neighbour under another summation
    order, moving that row's logits by a quantum: within the int8 bound, not within float32's.
    The kernel alone is held to float32's precision above."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    elif extension.extension() is None:
        pytest.skip(f"Linnet's CPU kernels do not run here: {extension.why_not()}")
    from linnet_core.cache import ArtifactCache
    from linnet_core.check.verify import verify

    r = verify(checkpoints[case], backend, fmt, steps=6, cache_len=64, cache=ArtifactCache(session_cache))
    assert r.activations == "int8" and r.passed and r.top1_agreement >= 0.8, r.to_json()
    if fmt == "q8_0":  # no exact ties from a q8_0 table: the same greedy tokens
        assert r.tokens_match, r.to_json()


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_gpu_path_is_the_cpu_kernels_math(fmt):
    """BlockLinear / BlockTable (a GPU session's blocks, float activations) run on any device: here,
    against the CPU kernel given activations already on its int8 grid."""
    from linnet_core.backends.torch_backend import BlockLinear, BlockTable

    g = torch.Generator().manual_seed(8)
    blocks = quantize(torch.randn(96, 128, generator=g), fmt)
    x, bias = int8_blocks(torch.randn(3, 128, generator=g)), torch.randn(96, generator=g)
    want = extension.quant_linear(x, extension.repack(blocks, fmt), fmt, 96, bias)
    assert torch.allclose(BlockLinear(blocks, fmt)(x, bias), want, atol=1e-4, rtol=1e-4)
    ids = torch.tensor([[5, 0, 95]])
    assert torch.equal(BlockTable(blocks, fmt)(ids), dequantize(blocks, fmt)[ids])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "inductor", "cudagraphs", "onnxruntime", "jax", "stablehlo"])
@pytest.mark.parametrize("case", ["qwen3-headdim128", "qwen3moe-experts"])  # the latter: experts' blocks per expert
def test_quantized_weights_on_cuda(case, backend, fmt, checkpoints, session_cache):
    """Every backend that runs blocks on a GPU, against the dequantized reference at float32's
    tolerance (ONNX Runtime's CUDA kernel dequantizes: no int8 activations there)."""
    from linnet_core.backends import get_backend
    from linnet_core.cache import ArtifactCache
    from linnet_core.errors import BackendUnavailable
    from linnet_core.check.verify import verify

    try:
        get_backend(backend).check_device("cuda")
    except BackendUnavailable as e:
        pytest.skip(e.message)
    r = verify(checkpoints[case], backend, fmt, steps=6, cache_len=64, device="cuda",
               cache=ArtifactCache(session_cache))
    assert r.passed and r.activations == "float32", r.to_json()


def test_export_onnx_carries_the_blocks(tokenized_checkpoints, tmp_path):
    """`export onnx --dtype q4_0`: MatMulNBits over the blocks, a float32 cache, and a graph ONNX Runtime opens."""
    ort = pytest.importorskip("onnxruntime")
    import json

    r = invoke("export", "onnx", tokenized_checkpoints["qwen3-headdim128"], tmp_path / "out", "--dtype", "q4_0")
    assert r.exit_code == 0, r.output
    info = json.loads((tmp_path / "out" / "interface.json").read_text())
    assert info["weights"] == "q4_0" and info["dtype"] == "float32"
    session = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert {i.name for i in session.get_inputs()} >= {"ids", "k_cache.0"}


def test_the_nbits_layout_holds_the_same_weights():
    from linnet_core.quant import NBITS, nbits_layout

    g = torch.Generator().manual_seed(5)
    for fmt in FORMATS:
        blocks = quantize(torch.randn(7, 96, generator=g), fmt)
        values, scales = nbits_layout(blocks, fmt)  # [7, 3, 32 * bits / 8], [7, 3]
        if NBITS[fmt] == 4:  # two to a byte, the low nibble first
            values = torch.stack([values & 0x0F, values >> 4], dim=-1).reshape(7, 3, 32)
        weights = (values.float() - (1 << (NBITS[fmt] - 1))) * scales[..., None]
        assert torch.equal(weights.reshape(7, 96), dequantize(blocks, fmt))


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_inductor_runs_the_same_kernels(fmt, checkpoints, session_cache):
    from linnet_core.cache import ArtifactCache
    from linnet_core.check.verify import verify

    r = verify(checkpoints["qwen2-bias-tied"], "inductor", fmt, steps=4, cache_len=64,
               cache=ArtifactCache(session_cache))
    assert r.passed and r.tokens_match, r.to_json()


@needs_kernels
def test_the_session_holds_blocks_not_floats(checkpoints, session_cache):
    from linnet_core.backends.cpu.linears import QuantLinear, QuantTable
    from linnet_core.cache import ArtifactCache
    from linnet_core.compile import load_model

    session, compiled = load_model(checkpoints["llama-gqa-untied"], "torch", "q4_0", 64,
                                   cache=ArtifactCache(session_cache), device="cpu")
    layer = session.weights["layers"][0]
    linears = [w for w in layer.values() if isinstance(w, QuantLinear)]
    assert linears and all(w.packed.dtype == torch.uint8 and w.fmt == "q4_0" for w in linears)
    assert isinstance(session.weights["global"]["token_embd.weight"], QuantTable)
    assert session.weights["global"]["output.weight"].fmt == "q8_0"  # the head, as llama.cpp keeps it wider
    assert compiled.artifact.name.split("-")[-3] == "q4_0"  # the format is part of the cache key


def test_a_tied_table_is_stored_once_as_the_head(checkpoints):
    from linnet_core.models import build_graph, load_spec
    from linnet_core.params import layout

    graph = build_graph(load_spec(checkpoints["qwen2-bias-tied"]))
    formats = param_formats(graph, "q4_0")
    assert formats["token_embd.weight"] == formats["output.weight"] == "q8_0"
    entries, aliases = layout(graph, "q4_0")
    assert aliases == {"output.weight": "token_embd.weight"}
    assert {n: d for n, _, d in entries}["blk.0.attn_q.weight"] == torch.uint8


@needs_kernels
def test_an_input_size_off_the_block_stays_float32_and_the_summary_says_so(tmp_path, session_cache):
    from linnet_core.cache import ArtifactCache
    from linnet_core.models import build_graph, load_spec
    from linnet_core.check.verify import verify

    case = next(c for c in CASES if c.id == "llama-gqa-untied")
    folder = make_checkpoint(case, tmp_path / "odd", intermediate_size=72)  # ffn_down takes 72 inputs
    line = summary(build_graph(load_spec(folder)), "q8_0")
    assert "input size not a multiple of 32: ffn_down.weight" in line
    r = verify(folder, "torch", "q8_0", steps=4, cache_len=64, cache=ArtifactCache(session_cache))
    assert r.passed and r.tokens_match


def test_backends_without_kernels_refuse_in_one_line(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "cache"))
    r = invoke("compile", checkpoints["llama-gqa-untied"], "--backend", "tensorrt", "--dtype", "q4")
    assert_one_line_error(r, 1, "the tensorrt backend has no kernels for q4_0 weights yet; q4_0 runs on: torch, "
                                "inductor, cudagraphs, onnxruntime, jax, stablehlo")
    assert not any((tmp_path / "cache").glob("artifacts/*"))  # nothing half-written


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf is not installed")
@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_gguf_export_holds_the_artifacts_very_blocks(fmt, tokenized_checkpoints, session_cache, tmp_path):
    """Byte for byte, tensor by tensor (a fused artifact weight is the export's rows side by side);
    and llama.cpp, where installed, computes on them within its own activation rounding."""
    from linnet_core.backends.artifact import WEIGHTS_FILE
    from linnet_core.cache import ArtifactCache
    from linnet_core.compile import compile_model
    from linnet_core.export.gguf_export import export_gguf
    from linnet_core.gguf.reader import read_gguf
    from linnet_core.weights import Checkpoint

    src = tokenized_checkpoints["qwen3-headdim128"]  # rope not interleaved in llama.cpp: rows as stored
    consumer = "llama.cpp" if importlib.util.find_spec("llama_cpp") else None
    result = export_gguf(src, tmp_path / "m.gguf", fmt, check=consumer is not None, consumer=consumer)
    if consumer:
        assert result.check.passed and result.check.top1_agreement >= 0.9, result.check.describe()
    artifact = compile_model(src, "torch", fmt, 64, cache=ArtifactCache(session_cache)).artifact
    stored = Checkpoint([artifact / WEIGHTS_FILE])
    with read_gguf(tmp_path / "m.gguf") as g:
        def raw(name):
            return np.frombuffer(bytes(g.raw(name)), dtype=np.uint8)  # a copy: the file closes after

        tied = "output.weight" not in g.tensors  # then the table is the head, and stored as the head is
        for name in ("blk.0.ffn_down.weight", "blk.1.attn_output.weight", "token_embd.weight") + ("output.weight",) * (not tied):
            head = name == "output.weight" or (tied and name == "token_embd.weight")
            assert g.tensors[name].type == ("Q8_0" if head else fmt.upper())
            assert np.array_equal(raw(name).reshape(-1), stored.get(name).numpy().reshape(-1)), name
        qkv = stored.get("blk.0.attn_qkv.weight").numpy()
        parts = [raw(f"blk.0.attn_{p}.weight").reshape(-1, qkv.shape[1]) for p in "qkv"]
        assert np.array_equal(np.concatenate(parts), qkv)


@needs_kernels
def test_run_takes_the_quantized_spelling(tokenized_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "cache"))
    r = invoke("run", tokenized_checkpoints["mistral-window"], "--dtype", "q4", "--cache-len", "64",
               "--prompt", "hello there", "--max-new-tokens", "5")
    assert r.exit_code == 0, r.output
    assert "torch q4_0" in r.output


def test_the_effect_measures_are_llama_cpps():
    from linnet_core.check.quant_effect import measure

    g = np.random.default_rng(0)
    logits = g.normal(size=(20, 50)).astype(np.float32) * 4  # [T, V]
    ids = list(g.integers(0, 50, 20))
    same = measure(logits, logits.copy(), ids, "q8_0", "t")
    assert same.mean_kld == pytest.approx(0, abs=1e-12) and same.top1_agreement == 1 and same.passed
    assert same.perplexity_float == same.perplexity_quantized
    off = measure(logits, logits + g.normal(size=logits.shape).astype(np.float32) * 3, ids, "q8_0", "t")
    assert off.mean_kld > 0.01 and not off.passed  # past q8_0's gate
    assert measure(logits, logits[::-1].copy(), ids, "q4_0", "t").passed  # q4_0: reported, not gated


@needs_kernels
def test_verify_reports_both_the_kernels_error_and_the_quantizations_cost(tmp_path, monkeypatch):
    """On the embedded (trained) model over text it never saw: q8_0 within its gate, q4_0 costs more."""
    from linnet_core.hub import DEFAULT_MODEL_DIR

    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "cache"))
    effects = {}
    for fmt in FORMATS:
        r = invoke("verify", DEFAULT_MODEL_DIR, "--dtype", fmt, "--json")
        assert r.exit_code == 0, r.output
        doc = __import__("json").loads(r.stdout)
        assert doc["passed"] and doc["distance"] <= doc["tolerance"]  # (a): the kernels, float32's bound
        effects[fmt] = doc["quantization"]
        assert effects[fmt]["text"] == "unseen text" and effects[fmt]["tokens"] > 200
    assert effects["q8_0"]["mean_kld"] <= 0.01 and effects["q8_0"]["top1_agreement"] >= 0.95
    assert effects["q8_0"]["gate"] and effects["q4_0"]["gate"] is None
    assert effects["q4_0"]["mean_kld"] > effects["q8_0"]["mean_kld"]
