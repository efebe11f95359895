"""ONNX emitter, ONNX Runtime and TensorRT backends, `linnet export onnx`: against the reference."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from family_fixtures import CASE_IDS

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from linnet_core.backends import get_backend  # noqa: E402
from linnet_core.backends.onnx_emit import LOWERINGS, emit_onnx  # noqa: E402
from linnet_core.compile import compile_model, load_model  # noqa: E402
from linnet_core.errors import BackendUnavailable, IRError  # noqa: E402
from linnet_core.ir.ops import OPS  # noqa: E402
from linnet_core.ir.passes import optimize  # noqa: E402
from linnet_core.models import build_graph, load_spec  # noqa: E402
from linnet_core.check.verify import verify  # noqa: E402
from linnet_core.weights import Checkpoint  # noqa: E402

STEPS = 8  # float32 and float16 against the reference, and batched rows: test_numerics.py


def test_every_op_has_a_lowering():
    assert set(LOWERINGS) == set(OPS)


def test_bfloat16_runs_or_says_why(checkpoints, reference):
    case = "qwen3-headdim128"
    try:
        r = verify(checkpoints[case], "onnxruntime", "bfloat16", steps=STEPS, reference=reference(case))
    except BackendUnavailable as e:  # the CPU provider has no bfloat16 MatMul
        assert "bfloat16" in e.message and "MatMul" in e.message and "\n" not in e.message
    else:
        assert r.dtype == "bfloat16" and r.passed


def test_auto_dtype_runs_float32_where_the_checkpoint_dtype_cannot(checkpoints, tmp_path):
    folder = tmp_path / "bf16"
    shutil.copytree(checkpoints["llama-gqa-untied"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    heard = []
    c = compile_model(folder, "onnxruntime", "auto", 32, progress=heard.append)
    try:
        get_backend("onnxruntime").check_available("bfloat16")
    except BackendUnavailable:  # the CPU provider: auto falls back and says so ...
        assert c.dtype == "float32" and any("auto picks float32" in h for h in heard)
        with pytest.raises(BackendUnavailable):  # ... but a dtype asked for by name is never swapped
            compile_model(folder, "onnxruntime", "bfloat16", 32)
    else:
        assert c.dtype == "bfloat16"


@pytest.mark.parametrize("case", CASE_IDS)
def test_emitted_models_pass_the_checker(case, checkpoints, tmp_path):
    artifact = compile_model(checkpoints[case], "onnxruntime", "float32", 64).artifact
    # The artifact's data file is a hard link to the cache's one stored copy, which ONNX's checker
    # refuses on principle (ONNX Runtime loads it): check a copy, as someone taking the files would.
    copy = shutil.copytree(artifact, tmp_path / "copy")
    onnx.checker.check_model(str(copy / "model.onnx"), full_check=True)
    info = json.loads((artifact / "interface.json").read_text())
    assert info["opset"] >= 23 and info["cache"]["layers"] == load_spec(checkpoints[case]).num_layers


def test_greedy_step_returns_tokens_not_logits(checkpoints):
    """The cache is updated in place (outputs bound to the inputs' buffers)."""
    session, _ = load_model(checkpoints["qwen2-bias-tied"], "onnxruntime", "float32", 32)
    before = session.caches["k_cache.0"].clone()
    out = session.prefill([1, 2, 3])
    assert out.logits is None and len(out.tokens) == 1
    after = session.caches["k_cache.0"]
    assert not torch.equal(before[:, :, :3], after[:, :, :3])  # written at positions 0..2
    assert torch.equal(before[:, :, 3:], after[:, :, 3:])  # and nowhere else


def test_missing_lowering_fails_at_emit_naming_the_op(checkpoints, tmp_path, monkeypatch):
    monkeypatch.delitem(LOWERINGS, "rope")
    graph = optimize(build_graph(load_spec(checkpoints["llama-gqa-untied"])))
    with pytest.raises(IRError, match="no lowering for op 'rope'"):
        emit_onnx(graph, Checkpoint.from_folder(checkpoints["llama-gqa-untied"]), "float32", 32, tmp_path)


def test_export_onnx_runs_in_plain_onnxruntime(checkpoints, tmp_path, reference):
    """The exported folder is enough on its own: interface.json tells how to drive the graph."""
    from typer.testing import CliRunner

    from linnet_cli.app import app

    path = checkpoints["phi3-fused-window"]
    out = tmp_path / "exported"
    r = CliRunner().invoke(app, ["export", "onnx", str(path), str(out), "--cache-len", "32", "--json"])
    assert r.exit_code == 0, r.stderr
    assert {"model.onnx", "model.onnx.data", "interface.json"} <= set(json.loads(r.stdout)["files"])
    again = CliRunner().invoke(app, ["export", "onnx", str(path), str(out)])
    assert again.exit_code == 1 and "--force" in again.stderr
    assert CliRunner().invoke(app, ["export", "onnx", str(path), str(out), "--force"]).exit_code == 0

    info = json.loads((out / "interface.json").read_text())
    c = info["cache"]
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    prompt = np.array([[3, 17, 42, 7, 99, 120]], dtype=np.int64)
    caches = {n: np.zeros((1, c["kv_heads"], info["cache_len"], c["head_dim"]), np.float32) for n in c["per_layer"]}
    feeds = {"ids": prompt, "start": np.array([0]), "slots": np.array([0]), "kv_len": np.array([6]),
             "logits_from": np.array([0]), **caches}
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    model = reference("phi3-fused-window")
    with torch.no_grad():
        expected = model(torch.from_numpy(prompt)).logits.numpy()
    assert np.abs(outputs["logits"] - expected).max() <= 1e-4
    assert outputs["next_token"][0] == expected[0, -1].argmax()


def test_the_fixed_form_session_takes_the_same_steps(checkpoints, tmp_path):
    """TensorRT runs the fixed [B, T] graph through OrtSession; on the CPU provider, that path
    gives the ragged artifact's tokens for prefill, batched decode and a mixed step."""
    from linnet_core.backends.ort_backend import OrtSession
    from linnet_core.runtime.session import Chunk

    path = checkpoints["mistral-window"]
    ragged, compiled = load_model(path, "onnxruntime", "float32", 32, rows=3)
    graph = optimize(build_graph(load_spec(path)))
    emit_onnx(graph, Checkpoint(sorted(path.glob("*.safetensors"))), "float32", 32, tmp_path)
    info = json.loads((compiled.artifact / "artifact.json").read_text())
    assert info["step"] == "ragged"
    fixed = OrtSession(ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"]),
                       {**info, "step": "dense"}, 3, "cpu", "onnxruntime")
    assert ragged.ragged and not fixed.ragged

    def run(s):
        tokens = [s.prefill(list(range(3, 3 + n)), slot=r).tokens[0] for r, n in enumerate((5, 9, 2))]
        tokens += s.decode([5, 6, 7], [5, 9, 2], [0, 1, 2]).tokens
        tokens += s.step([Chunk([8], 6, 0), Chunk(list(range(20, 27)), 3, 2), Chunk([9], 10, 1)])
        return tokens, s.prefill([11, 12], slot=1, start=11, logits="all").logits

    (want, want_logits), (got, got_logits) = run(ragged), run(fixed)
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, atol=2e-5, rtol=1e-5)


def test_bad_export_input_leaves_nothing(tmp_path):
    from typer.testing import CliRunner

    from linnet_cli.app import app

    r = CliRunner().invoke(app, ["export", "onnx", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert r.exit_code == 1 and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_weights_over_2gb_go_to_external_data(tmp_path):
    """Protobuf caps a message at 2 GB: a bigger model must still emit (it need not run)."""
    from linnet_core.models import spec_from_config
    from linnet_core.weights import write_safetensors

    cfg = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000}
    spec = spec_from_config(cfg)
    graph = optimize(build_graph(spec))
    ckpt_dir = tmp_path / "big"
    ckpt_dir.mkdir()
    (ckpt_dir / "config.json").write_text(json.dumps(cfg))
    unfused = build_graph(spec)  # one param per checkpoint tensor, with its shape
    shapes = {p.sources(layer)[0]: p.shape for _, p, layer in unfused.all_params()}
    names = sorted(shapes)
    gen = torch.Generator().manual_seed(0)
    write_safetensors(ckpt_dir / "model.safetensors", [(n, shapes[n], torch.float32) for n in names],
                      (torch.rand(shapes[n], generator=gen) for n in names))
    out = tmp_path / "onnx"
    out.mkdir()
    emit_onnx(graph, Checkpoint.from_folder(ckpt_dir), "float32", 64, out)
    assert (out / "model.onnx.data").stat().st_size > 2**31
    assert (out / "model.onnx").stat().st_size < 10 * 2**20  # the graph proto holds no weights
    onnx.checker.check_model(str(out / "model.onnx"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", ["llama-gqa-untied", "qwen3-headdim128", "phi3-fused-window"])
def test_tensorrt_matches_transformers_and_caches_its_engine(case, dtype, checkpoints, reference):
    skip_unless_runs_on_cuda("tensorrt")
    first = compile_model(checkpoints[case], "tensorrt", dtype, 64)
    assert any((first.artifact / "tensorrt").iterdir())  # engine and timing cache in the artifact
    assert compile_model(checkpoints[case], "tensorrt", dtype, 64).hit
    r = verify(checkpoints[case], "tensorrt", dtype, steps=STEPS, reference=reference(case))
    assert r.passed, r


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_onnxruntime_cuda_matches_transformers(dtype, checkpoints, reference):
    skip_unless_runs_on_cuda("onnxruntime")
    case = "qwen3-headdim128"
    r = verify(checkpoints[case], "onnxruntime", dtype, steps=STEPS, reference=reference(case), device="cuda")
    assert r.passed, r


def skip_unless_runs_on_cuda(backend: str) -> None:
    """A GPU machine without onnxruntime-gpu or TensorRT skips these, saying which is missing."""
    try:
        get_backend(backend).check_device("cuda")
    except BackendUnavailable as e:
        pytest.skip(e.message)


def test_tensorrt_without_a_gpu_says_which(checkpoints):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu tests cover TensorRT")
    with pytest.raises(BackendUnavailable, match="needs an NVIDIA GPU"):
        compile_model(checkpoints["llama-gqa-untied"], "tensorrt", "float16", 32)
    assert get_backend("tensorrt").title == "TensorRT"
