"""The compiled backends (jax, inductor, cudagraphs): buckets, caches on disk, warm loads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from linnet_core.backends import get_backend
from linnet_core.compile import compile_model, load_model
from linnet_core.errors import BackendUnavailable
from linnet_core.check.verify import verify

COMPILED = ["inductor"] + (["jax", "stablehlo"] if importlib.util.find_spec("jax") else [])
CACHE_FOLDER = {"jax": "xla_cache", "inductor": "inductor_cache", "stablehlo": "stablehlo"}


@pytest.mark.parametrize("backend", COMPILED)
def test_compile_fills_the_compiler_cache_inside_the_artifact(backend, checkpoints):
    c = compile_model(checkpoints["qwen3-headdim128"], backend, "float32", 48)
    cache = c.artifact / CACHE_FOLDER[backend]
    assert cache.is_dir() and any(p.is_file() for p in cache.rglob("*"))


@pytest.mark.parametrize("backend", COMPILED)
def test_prompts_of_every_length_and_padded_batches(backend, checkpoints):
    """Padding to buckets never changes a token: lengths across bucket edges, odd batch sizes."""
    path = checkpoints["llama-gqa-untied"]
    ref, _ = load_model(path, "torch", "float32", 48, rows=3)
    got, _ = load_model(path, backend, "float32", 48, rows=3)
    for n in (1, 15, 16, 17, 40):
        prompt = [(7 * i + 3) % 160 for i in range(n)]
        assert got.prefill(prompt, slot=1).tokens == ref.prefill(prompt, slot=1).tokens, n
    for s in (0, 2):
        ref.prefill([5, 6, 7], slot=s)
        got.prefill([5, 6, 7], slot=s)
    for k in range(3):  # three rows decoded together: padded to a batch of four
        a = ref.decode([9, 8, 7], [40 + k, 3 + k, 3 + k], [1, 0, 2], logits=True)
        b = got.decode([9, 8, 7], [40 + k, 3 + k, 3 + k], [1, 0, 2], logits=True)
        assert a.tokens == b.tokens
        assert abs(a.logits - b.logits).max() <= 1e-4


@pytest.mark.parametrize("backend", [b for b in COMPILED if b != "stablehlo"])
def test_a_warm_load_does_not_compile_again(backend, checkpoints, session_cache):
    """A second process finds the compiled code in the artifact: it loads, it does not compile."""
    path = checkpoints["phi3-fused-window"]
    compile_model(path, backend, "float32", 40)
    script = f"""
import json, time, logging
from linnet_core.compile import load_model
t = time.perf_counter()
s, c = load_model({str(path)!r}, {backend!r}, "float32", 40)
s.prefill([1, 2, 3]); s.decode([4], [3], [0])
print(json.dumps({{"hit": c.hit, "seconds": time.perf_counter() - t}}))
"""
    env = {**os.environ, "LINNET_CACHE": str(session_cache)}
    if backend == "jax":
        env["JAX_LOG_COMPILES"] = "1"  # logs each compile, and each persistent-cache hit and miss
        env["JAX_EXPLAIN_CACHE_MISSES"] = "1"
    else:
        env["TORCH_LOGS"] = "inductor"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["hit"]
    if backend == "jax":
        assert "jit_step" in out.stderr  # the log speaks of the model's step ...
        assert "MISS for 'jit_step'" not in out.stderr  # ... which was loaded, not compiled
    else:
        assert "fx graph cache miss" not in out.stderr.lower()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cudagraphs_matches_transformers(dtype, checkpoints, reference):
    r = verify(checkpoints["qwen3-headdim128"], "cudagraphs", dtype, steps=8, reference=reference("qwen3-headdim128"))
    assert r.passed, r


def test_cudagraphs_without_a_gpu_says_so(checkpoints):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu tests cover CUDA graphs")
    with pytest.raises(BackendUnavailable, match="need an NVIDIA GPU"):
        compile_model(checkpoints["llama-gqa-untied"], "cudagraphs", "float32", 32)
    assert get_backend("cudagraphs").title == "CUDA graphs"


@pytest.mark.skipif(not importlib.util.find_spec("jax"), reason="JAX is not installed (pip install 'linnet[jax]')")
def test_stablehlo_warm_load_deserializes(checkpoints, monkeypatch):
    """The artifact keeps each bucket's module text and executable: a new session emits nothing."""
    import linnet_core.backends.stablehlo_backend as shlo

    path = checkpoints["qwen2-bias-tied"]
    c = compile_model(path, "stablehlo", "float32", 40)
    kept = sorted(p.name for p in (c.artifact / "stablehlo").iterdir())
    assert any(n.endswith(".mlir") for n in kept) and any(n.endswith(".xla") for n in kept)

    def no_emit(*args, **kwargs):
        raise AssertionError("a warm load emitted StableHLO again")

    monkeypatch.setattr(shlo, "emit_stablehlo", no_emit)
    session, again = load_model(path, "stablehlo", "float32", 40)
    assert again.hit
    session.prefill([1, 2, 3])
    session.decode([4], [3], [0])
