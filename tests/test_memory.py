"""Memory at real size, checked on a ~280M model in child processes against the formulas:
a compile streams (peak ≤ largest prepared tensor × 4 + 1 GiB above the process's start), a CPU
session holds each weight once (peak ≤ 1.15 × prepared weights + KV cache + 0.5 GiB), and what
cannot fit is refused in one line from the sizes before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_cli import assert_one_line_error, invoke

from linnet_core.errors import BackendUnavailable

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
CACHE_LEN = 160

PROBE = textwrap.dedent("""
    import json, os, sys
    os.environ["LINNET_MEMORY_CHECK"] = "0"
    from linnet_core.bench.machine import peak_rss
    from linnet_core.cache import ArtifactCache
    from linnet_core.compile import compile_model, load_model
    import linnet_core.backends.{module}  # every import a session needs, before the start is taken
    def rss(field="VmRSS:"):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    start = rss()
    cache = ArtifactCache(sys.argv[4])
    if sys.argv[1] == "compile":
        c = compile_model(sys.argv[2], sys.argv[3], sys.argv[5], {cache_len}, cache=cache)
    else:
        session, c = load_model(sys.argv[2], sys.argv[3], sys.argv[5], {cache_len}, cache=cache)
        session.prefill(list(range(1, 33)))
        session.decode([5], [32], [0])
    print(json.dumps({{"start": start, "peak": peak_rss(), "anon": rss("RssAnon:"), "artifact": str(c.artifact)}}))
""")
MODULES = {"torch": "torch_backend", "inductor": "inductor_backend", "jax": "jax_backend",
           "stablehlo": "stablehlo_backend", "onnxruntime": "ort_backend"}


@pytest.fixture(scope="module")
def model_280m(tmp_path_factory) -> Path:
    """A Qwen3 of ~280M parameters in bfloat16 (16 layers of hidden 1024, vocab 32000, untied)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from make_seed_models import write_random_checkpoint
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=64, vocab_size=32000, max_position_embeddings=4096,
                         tie_word_embeddings=False, dtype="bfloat16")
    return write_random_checkpoint(config, tmp_path_factory.mktemp("m280") / "qwen3-280m", shard_gb=0.25)


def probe(what: str, model: Path, backend: str, dtype: str, cache: Path) -> dict:
    script = PROBE.format(module=MODULES[backend], cache_len=CACHE_LEN)
    r = subprocess.run([sys.executable, "-c", script, what, str(model), backend, str(cache), dtype],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def prepared_bytes(artifact: Path) -> tuple[int, int]:
    """(all prepared weights, the largest single tensor) from the artifact's weights file."""
    from linnet_core.weights import read_header

    path = artifact / "weights.safetensors"
    if not path.is_file():
        path = artifact / "model.onnx.data"
        from linnet_core.backends.onnx_emit import external_layout
        from linnet_core.backends.artifact import read_graph

        entries = external_layout(read_graph(artifact), json.loads((artifact / "artifact.json").read_text())["dtype"])
        return sum(e[3] for e in entries), max(e[3] for e in entries)
    infos, _, _ = read_header(path)
    return sum(i.nbytes for i in infos.values()), max(i.nbytes for i in infos.values())


# The XLA backends in float32: in half precision XLA's CPU compiler converts the weights to float32
# at every call (weight_copies says so, and the size check counts it), a limit of that compiler.
# Sessions that compute on the mapped weights (ONNX Runtime: MLAS's prepacking off on CPU).
MAPPED = ("torch", "onnxruntime")
CASES = [("torch", "bfloat16"), ("jax", "float32"), ("onnxruntime", "float32"), ("stablehlo", "float32"),
         ("inductor", "bfloat16")]


@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype", CASES)
def test_compile_streams_and_a_session_holds_each_weight_once(model_280m, backend, dtype, tmp_path):
    import importlib.util

    from linnet_core.backends import get_backend
    from linnet_core.compile import open_model
    from linnet_core.memory import kv_cache_bytes

    if backend in ("jax", "stablehlo") and not importlib.util.find_spec("jax"):
        pytest.skip("JAX is not installed")
    if backend == "onnxruntime" and not importlib.util.find_spec("onnxruntime"):
        pytest.skip("ONNX Runtime is not installed")
    cache = tmp_path / "cache"
    built = probe("compile", model_280m, backend, dtype, cache)
    weights, largest = prepared_bytes(Path(built["artifact"]))
    assert built["peak"] - built["start"] <= largest * 4 + GIB, (built, largest)
    loaded = probe("load", model_280m, backend, dtype, cache)
    kv = kv_cache_bytes(open_model(model_280m).spec, get_backend(backend).kv_cache_dtype(dtype), CACHE_LEN, 1)
    # The bound allows 0.5 GiB of runtime; JAX's (jaxlib beside torch) is ~0.45 GiB before any
    # weight, and its float32 session lands within a megabyte of that bound: 0.6 GiB for the XLA two.
    runtime = 0.6 * GIB if backend in ("jax", "stablehlo") else GIB / 2
    bound = 1.15 * weights + kv + runtime
    assert loaded["peak"] <= bound, f"peak {loaded['peak'] / GIB:.2f} GiB > {bound / GIB:.2f} GiB"
    if backend in MAPPED:  # the weights stay the page cache's pages: no anonymous copy of them
        assert loaded["anon"] <= weights / 4 + runtime, f"{loaded['anon'] / GIB:.2f} GiB anonymous"


def test_what_cannot_fit_is_refused_from_the_sizes(checkpoints, monkeypatch):
    import linnet_core.memory as memory
    from linnet_core.compile import load_model

    monkeypatch.setattr(memory, "available_bytes", lambda: 100 * 2**20)
    with pytest.raises(BackendUnavailable, match=r"needs about 0\.5 GiB here .* has 0\.1 GiB available") as e:
        load_model(checkpoints["llama-gqa-untied"], "torch", "float32", 32)
    assert "LINNET_MEMORY_CHECK=0" in e.value.hint
    monkeypatch.setenv("LINNET_MEMORY_CHECK", "0")
    session, _ = load_model(checkpoints["llama-gqa-untied"], "torch", "float32", 32)
    assert session.prefill([1, 2]).tokens


def test_the_cli_refuses_in_one_line(checkpoints, monkeypatch):
    import linnet_core.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 2**20)
    r = invoke("verify", str(checkpoints["qwen2-bias-tied"]), "--backend", "torch", "--cache-len", "40")
    assert_one_line_error(r, BackendUnavailable.exit_code, "needs about")


def test_session_estimate_counts_weights_once_and_the_tied_head_per_layout(checkpoints):
    from linnet_core.compile import open_model
    from linnet_core.memory import weight_bytes

    spec = open_model(checkpoints["qwen3-headdim128"]).spec  # tied head
    once, twice = weight_bytes(spec, "float32", 1), weight_bytes(spec, "float32", 2)
    assert twice - once == spec.vocab_size * spec.hidden_size * 4


def test_a_reference_too_big_for_float32_runs_in_the_checks_dtype(checkpoints, monkeypatch):
    """verify holds one model at a time; when float32 would not fit, the reference runs in half precision."""
    import linnet_core.memory as memory
    from linnet_core.compile import open_model
    from linnet_core.check.reference import reference_dtype
    from linnet_core.check.agreement import TOLERANCE
    from linnet_core.check.verify import verify

    path = checkpoints["llama-gqa-untied"]
    spec = open_model(path).spec
    assert reference_dtype(spec, "bfloat16") == "float32"  # a small model: float32, as always
    monkeypatch.setattr(memory, "available_bytes", lambda: memory.weight_bytes(spec, "float32") + 2**29)
    assert reference_dtype(spec, "bfloat16") == "bfloat16" and reference_dtype(spec, "f16") == "float16"
    monkeypatch.setenv("LINNET_MEMORY_CHECK", "0")
    r = verify(path, "torch", "bfloat16", steps=4)
    assert r.reference_dtype == "bfloat16" and r.passed, r
    assert r.tolerance >= 2 * TOLERANCE["bfloat16"]  # doubled: the reference rounds as much as the backend
