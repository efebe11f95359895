"""What of the GPU paths can be checked without a GPU: provider options, TensorRT's profile and
engine-cache key, where each backend says it can run, the seed models' shapes, the bench's time
limit, and the GPU pass itself as a dry run on this CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from linnet_core.backends import get_backend
from linnet_core.backends.ort_backend import cuda_provider_options
from linnet_core.backends.tensorrt_backend import MAX_ROWS, profile_shapes, tensorrt_provider_options
from linnet_core.bench.machine import nominal_bandwidth
from linnet_core.cache import ArtifactKey
from linnet_core.errors import BackendUnavailable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))


def test_cuda_provider_runs_on_torchs_device_and_stream():
    opts = cuda_provider_options(1, 0x7F00DEAD)
    assert opts["device_id"] == "1"
    assert opts["user_compute_stream"] == str(0x7F00DEAD)  # ONNX Runtime reads the handle as a decimal string
    assert opts["arena_extend_strategy"] == "kSameAsRequested"
    assert all(isinstance(v, str) for v in opts.values())


def _parse_profile(text: str) -> dict[str, list[int]]:
    return {name: [int(d) for d in dims.split("x")] for name, dims in (item.split(":") for item in text.split(","))}


def test_tensorrt_profile_names_every_input_of_the_dense_graph(checkpoints):
    """The profile's names and ranks are the emitted ONNX model's inputs, min <= opt <= max."""
    from linnet_core.backends.onnx_emit import build_onnx
    from linnet_core.compile import open_model
    from linnet_core.models import build_graph

    m = open_model(checkpoints["qwen3-headdim128"])
    graph = get_backend("tensorrt").lower(build_graph(m.spec))
    assert not graph.ragged  # TensorRT's builder takes the dense [B, T] step
    model = build_onnx(graph, "bfloat16", 64)
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in model.graph.input}
    c = graph.cache
    info = {"cache": {"layers": c.layers, "kv_heads": c.kv_heads, "head_dim": c.head_dim}, "cache_len": 64,
            "dtype": "bfloat16"}
    opts = tensorrt_provider_options(info, Path("/artifact/tensorrt"), MAX_ROWS)
    lo, opt, hi = (_parse_profile(opts[f"trt_profile_{k}_shapes"]) for k in ("min", "opt", "max"))
    assert set(lo) == set(opt) == set(hi) == set(ranks)
    for name, rank in ranks.items():
        assert len(lo[name]) == len(hi[name]) == rank
        assert all(a <= b <= h for a, b, h in zip(lo[name], opt[name], hi[name])), name
    assert hi["ids"] == [MAX_ROWS, 64] and hi["k_cache.0"] == [MAX_ROWS, c.kv_heads, 64, c.head_dim]
    assert (opts["trt_bf16_enable"], opts["trt_fp16_enable"]) == ("True", "False")
    assert opts["trt_engine_cache_path"] == opts["trt_timing_cache_path"] == "/artifact/tensorrt"


def test_tensorrt_profile_point_is_one_token_of_one_row():
    shapes = _parse_profile(profile_shapes({"layers": 1, "kv_heads": 2, "head_dim": 8}, 32, 1, 1, 1))
    assert shapes["ids"] == [1, 1] and shapes["start"] == [1] and shapes["kv_len"] == [1]
    assert shapes["v_cache.0"] == [1, 2, 32, 8]


def test_tensorrt_engine_key_follows_the_gpu_and_tensorrt(monkeypatch):
    """An engine is valid for one GPU model and one TensorRT version: both are in the cache key."""
    pytest.importorskip("onnxruntime")
    backend = get_backend("tensorrt")
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.9.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def key(gpu: str) -> str:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
        tc = tuple(sorted(backend.cache_toolchain().items()))
        return ArtifactKey("m", "id", "tensorrt", "bfloat16", 64, tc).digest

    h100, h200 = key("NVIDIA H100 80GB HBM3"), key("NVIDIA H200")
    assert h100 != h200 and key("NVIDIA H200") == h200
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.10.0"))
    assert key("NVIDIA H200") != h200
    assert backend.toolchain()["tensorrt"] == "10.10.0"


@pytest.mark.parametrize("backend,message", [
    ("cudagraphs", "CUDA graphs run on NVIDIA GPUs only"),
    ("tensorrt", "TensorRT runs on NVIDIA GPUs only"),
])
def test_gpu_only_backends_refuse_the_cpu(backend, message):
    with pytest.raises(BackendUnavailable, match=message):
        get_backend(backend).check_device("cpu")


def test_backends_say_what_they_lack_for_cuda(monkeypatch):
    """With a GPU visible, a toolchain without CUDA kernels is named: never a quiet run on the CPU."""
    if not torch.cuda.is_available():
        for name in ("torch", "inductor", "jax"):
            with pytest.raises(BackendUnavailable, match="needs an NVIDIA GPU"):
                get_backend(name).check_device("cuda")
            assert get_backend(name).default_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(BackendUnavailable, match="no CUDA execution provider") as e:
            get_backend("onnxruntime").check_device("cuda")
        assert "onnxruntime-gpu" in e.value.hint
        assert get_backend("onnxruntime").default_device() == "cpu"
    assert get_backend("onnxruntime").providers("cuda") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert get_backend("onnxruntime").providers("cpu") == ["CPUExecutionProvider"]
    from linnet_core.backends import jax_backend

    if importlib.util.find_spec("jax") and not jax_backend.has_cuda_plugin():
        with pytest.raises(BackendUnavailable, match="no CUDA plugin"):
            get_backend("stablehlo").check_device("cuda")


def test_unknown_device_is_refused():
    with pytest.raises(BackendUnavailable, match="unknown device 'tpu'"):
        get_backend("torch").check_device("tpu")


def test_nominal_bandwidth_of_the_pages_gpus():
    assert nominal_bandwidth("NVIDIA H200") == 4.8e12
    assert nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert nominal_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert nominal_bandwidth("a GPU nobody has heard of") is None


# --- the seed models -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,params,tied,window", [
    ("phi-3-mini-4k-instruct", 3.82e9, False, 2047),
    ("qwen3-4b", 4.02e9, True, None),
    ("mistral-7b-instruct-v0.3", 7.25e9, False, None),
    ("gemma-2-2b-it", 2.61e9, True, 4096),
    ("gemma-3-4b-it", 3.88e9, True, 1024),  # the text model of its 4.3B (a 0.42B vision tower beside it)
])
def test_seed_configs_are_the_real_models(name, params, tied, window):
    """Parameter counts as the model cards give them (shapes from the meta device: no memory)."""
    from make_seed_models import seed_config, tensor_shapes

    config = seed_config(name)
    shapes = tensor_shapes(config)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    assert abs(n - params) / params < 0.01, n
    assert config.tie_word_embeddings is tied and ("lm_head.weight" in shapes) is not tied
    assert getattr(config, "sliding_window", None) == window


def test_the_moe_seed_is_qwen3_30b_a3b_and_a_tiny_one_runs_beside_llama_cpp(tmp_path):
    """The seed is the published model's config (tests/test_spec.py counts its parameters against the
    model card); the same family at test size, written straight to a q4_0 GGUF, verifies against
    llama.cpp on the file."""
    import transformers
    from make_seed_models import GGUF_SEEDS, write_gguf_seed
    from test_spec import QWEN3_30B_A3B

    from linnet_core.check.verify import verify
    from linnet_core.gguf.reader import read_gguf
    from linnet_core.models import spec_from_config

    cls, fields, _, fmt = GGUF_SEEDS["qwen3-30b-a3b"]
    seed, published = spec_from_config(getattr(transformers, cls)(**fields).to_dict()), spec_from_config(QWEN3_30B_A3B)
    unset = {"bos_token_id": None, "eos_token_ids": (), "dtype": None}  # the tokenizer's and the file's
    assert seed.to_json() | unset == published.to_json() | unset
    pytest.importorskip("llama_cpp")
    from linnet_core.backends.cpu import extension

    if extension.extension() is None:
        pytest.skip(f"q4_0 needs Linnet's CPU kernels: {extension.why_not()}")
    tiny = write_gguf_seed("qwen3-30b-a3b", tmp_path / "moe.gguf", tiny=True)
    with read_gguf(tiny) as g:
        assert g.metadata["general.architecture"] == "qwen3moe" and g.metadata["qwen3moe.expert_count"] == 8
    r = verify(tiny, "torch", fmt, steps=4, prompt="Hello world")
    assert r.passed and r.tokens_match, r


def test_seed_shards_stay_under_their_size():
    from make_seed_models import plan_shards

    shapes = {f"t{i}": (1024, 1024) for i in range(10)} | {"big": (4096, 1024)}
    shards = plan_shards(shapes, 3 * 2**21)  # 3 tensors of 2 MiB each
    assert [len(s) for s in shards] == [3, 3, 3, 1, 1]
    assert sum(shards, []) == list(shapes)


def test_a_branch_scale_scales_the_output_projections_alone():
    """--branch-scale (a pair that agrees, for speculative decoding's bench) draws the attention's and
    the MLP's output projections with a smaller std and every other tensor as before."""
    from make_seed_models import random_tensor

    for name, shape in [("model.layers.0.self_attn.o_proj.weight", (512, 256)),
                        ("model.layers.0.mlp.down_proj.weight", (512, 384))]:
        plain, scaled = random_tensor(name, shape).float(), random_tensor(name, shape, 0.05).float()
        assert scaled.std() / plain.std() == pytest.approx(0.05, rel=0.02)
    for name, shape in [("model.layers.0.self_attn.q_proj.weight", (512, 256)), ("model.embed_tokens.weight", (300, 64)),
                        ("model.layers.0.input_layernorm.weight", (64,))]:
        assert torch.equal(random_tensor(name, shape), random_tensor(name, shape, 0.05))


def test_tiny_seed_is_a_complete_checkpoint(tmp_path):
    from make_seed_models import write_seed

    from linnet_core.check.verify import verify

    folder = write_seed("mistral-7b-instruct-v0.3", tmp_path / "m", tiny=True, shard_gb=0.004)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, one shard written at a time
    r = verify(folder, "torch", "bfloat16", steps=4, prompt="Hello world")
    assert r.passed, r


# --- the bench's time limit ----------------------------------------------------------------------

def test_bench_time_limit_keeps_what_it_reached(checkpoints, tmp_path):
    from linnet_core.bench.run import TIME_LIMIT_REASON, bench
    from linnet_core.bench.subjects import Method, pick

    method = Method(prompt_tokens=8, new_tokens=4, runs=2, warmups=0)
    result = bench(checkpoints["llama-gqa-untied"], method, pick(["torch"], []), "cpu", tmp_path,
                   time_limit=1e-6)
    assert result.time_limited and not result.interrupted
    assert {s.status for s in result.sides} == {"failed"}
    assert all(s.reason == TIME_LIMIT_REASON for s in result.sides)
    assert result.to_json()["time_limited"] is True


# --- the GPU pass, as a dry run ------------------------------------------------------------------

@pytest.mark.slow
def test_gpu_pass_dry_run(tmp_path):
    """The pass's every step on this CPU at tiny sizes, through its shell entry point."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != "LINNET_CACHE"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_pass.sh"), "--dry-run", "--work", str(work)],
                          env={**env, "OUT": str(out), "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from gpu_pass import OUTPUTS

    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)
    assert all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    summary = json.loads((out / "pass.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["install", "doctor", "tests", "fixtures", "verify", "bench"]
    assert all(s["status"] == "ok" for s in summary["steps"]), summary["steps"]
    by = {(r["backend"], r["dtype"]): r for r in summary["verify"]}
    assert by[("torch", "bfloat16")]["status"] == "passed" and by[("jax", "q8_0")]["status"] == "passed"
    assert by[("jax", "float16")]["status"] == "missing" and "inductor" in by[("jax", "float16")]["reason"]
    assert by[("cudagraphs", "bfloat16")]["status"] == "missing"  # said in the report, not a failure
    assert "NVIDIA GPU" in by[("tensorrt", "float16")]["reason"]
    rows = {r["label"]: r for r in summary["bench"]["rows"]}
    assert rows["transformers"]["decode_tok_s"] > 0 and rows["Linnet, generated PyTorch"]["decode_tok_s"] > 0
    assert rows["Linnet, TensorRT"]["status"] == "missing"
    doc = json.loads((out / "bench.json").read_text())
    assert doc["spec"]["vocab_size"] == 151936 and doc["method"]["prompt_tokens"] == 32
    assert "<html" in (out / "bench.html").read_text()
    assert "| verify |" in (out / "pass.log").read_text()
