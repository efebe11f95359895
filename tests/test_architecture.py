"""The architecture's contracts: every emitter lowers every op, every family and backend follows
the documented contract, the ragged step is a verified pass, what was compiled is what is loaded,
and the defects found reading the code stay fixed."""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from import_graph import ImportGraph

from linnet_core.backends import REGISTRY, get_backend
from linnet_core.backends.artifact import import_generated
from linnet_core.backends.base import Backend
from linnet_core.errors import CheckpointError, IRError, LinnetError
from linnet_core.ir.graph import Graph
from linnet_core.ir.ops import OPS
from linnet_core.ir.passes import optimize
from linnet_core.ir.ragged import DENSE_ONLY_OPS, to_ragged
from linnet_core.ir.verify import verify
from linnet_core.models import FAMILIES, FAMILY_CONTRACT, build_graph, load_spec
from linnet_core.models.decoder import check_weight_map

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def emitter_tables() -> dict[str, tuple[dict, bool]]:
    """Every emitter's op table, and whether it renders only the ragged step form."""
    from linnet_core.backends import onnx_emit, stablehlo_emit
    from linnet_core.backends.jax_emit import JAX
    from linnet_core.backends.torch_emit import TORCH, TORCH_RAGGED

    return {"generated PyTorch (dense)": (TORCH.templates, False),
            "generated PyTorch (ragged)": (TORCH_RAGGED.templates, True),
            "generated JAX": (JAX.templates, False),
            "ONNX": (onnx_emit.LOWERINGS, False), "StableHLO": (stablehlo_emit.LOWERINGS, False)}


@pytest.mark.parametrize("emitter", list(emitter_tables()))
def test_every_emitter_lowers_every_op(emitter):
    table, ragged_only = emitter_tables()[emitter]
    needed = [op for op in OPS if not (ragged_only and op in DENSE_ONLY_OPS)]
    missing = [op for op in needed if op not in table]
    assert not missing, f"the {emitter} emitter has no lowering for op(s): {', '.join(missing)}"
    unknown = [op for op in table if op not in OPS]
    assert not unknown, f"the {emitter} emitter lowers op(s) the IR does not have: {', '.join(unknown)}"


def test_family_modules_follow_the_contract_and_the_doc_lists_it():
    doc = (DOCS / "adding-a-family.md").read_text()
    for name, module in FAMILIES.items():
        missing = [attr for attr in FAMILY_CONTRACT if not hasattr(module, attr)]
        assert not missing, f"family {name} lacks {missing}"
    for attr in FAMILY_CONTRACT:
        assert f"`{attr}" in doc, f"docs/adding-a-family.md does not mention {attr}"
    for path in re.findall(r"`((?:linnet_core|tests|docs)/[\w/.-]+\.(?:py|md))`", doc):
        assert (ROOT / path).exists(), f"docs/adding-a-family.md names {path}, which does not exist"


def test_backends_follow_one_skeleton_and_the_doc_lists_it():
    doc = (DOCS / "adding-a-backend.md").read_text()
    for name in REGISTRY:
        module, cls = REGISTRY[name].split(":")
        backend = getattr(importlib.import_module(module), cls)
        assert backend.compile is Backend.compile, f"backend {name} overrides the compile template"
        assert backend.emit is not Backend.emit and backend.load is not Backend.load
    for hook in ("emit", "load", "toolchain", "check_available", "write_weights", "finish", "ragged", "REGISTRY"):
        assert f"`{hook}" in doc, f"docs/adding-a-backend.md does not mention {hook}"
    for path in re.findall(r"`((?:linnet_core|tests|docs)/[\w/.-]+\.(?:py|md))`", doc):
        assert (ROOT / path).exists(), f"docs/adding-a-backend.md names {path}, which does not exist"


def _cycle_lines(graph: ImportGraph, group: list[str]) -> str:
    return "; ".join(f"{i.importer}:{i.line} -> {i.target}" for i in graph.imports
                     if i.importer in group and i.target in group)


def test_linnets_modules_import_one_another_without_a_cycle():
    """Top-level and function-local imports alike: a cycle hidden in a function is still a cycle."""
    graph = ImportGraph(ROOT, ("linnet_core", "linnet_cli"))
    assert len(graph.files) > 100 and sum(not i.top_level for i in graph.imports) > 0  # the walk saw both kinds
    cycles = graph.cycles()
    assert not cycles, "import cycles: " + " | ".join(_cycle_lines(graph, c) for c in cycles)


def test_the_import_walk_finds_a_cycle_through_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for path, text in {"__init__.py": "", "a.py": "from .sub import b\n", "sub/__init__.py": "",
                       "sub/b.py": "def f():\n    from ..a import x  # a reason\n",
                       "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n"}.items():
        (pkg / path).write_text(text)
    graph = ImportGraph(tmp_path, ("pkg",))
    assert graph.cycles() == [["pkg.a", "pkg.sub.b"]]  # c's TYPE_CHECKING import is no edge


def test_function_local_imports_of_linnets_modules_say_why():
    """A Linnet module is imported at the top of the file, unless it loads a heavy package (torch,
    transformers, fastapi...) that the importing module does not: then in the function, with a comment."""
    graph = ImportGraph(ROOT, ("linnet_core", "linnet_cli"))
    wrong = [f"{i.importer}:{i.line} ({i.target})" for i in graph.imports
             if not i.top_level and i.target in graph.files
             and not (graph.heavy(i.target) and not graph.heavy(i.importer) and "#" in i.text)]
    assert not wrong, f"import these at the top of the file, or say why not in the line: {wrong}"


def test_the_public_api_names_resolve():
    """`from linnet_core import verify, read_gguf, ...`: every name the package offers, wherever it moved."""
    import linnet_core

    for name in linnet_core.__all__:
        assert callable(getattr(linnet_core, name)) or name == "__version__", name


def test_cited_scripts_exist():
    """Comments and docs cite bench and scripts files by path; every one must exist."""
    cited = set()
    for path in list((ROOT / "linnet_core").rglob("*.py")) + list((ROOT / "linnet_cli").rglob("*.py")) \
            + [ROOT / "README.md", *DOCS.glob("*.md")]:
        cited |= set(re.findall(r"(?<![\w/])((?:bench|scripts)/[\w/-]+\.(?:py|sh))\b", path.read_text()))
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, f"cited but missing: {missing}"


@pytest.fixture(scope="module")
def graph(checkpoints) -> Graph:
    return optimize(build_graph(load_spec(checkpoints["qwen3-headdim128"])))


def test_ragged_pass_is_verified_and_marks_every_form_dependent_node(graph):
    ragged = to_ragged(graph)
    assert ragged.ragged and not graph.ragged and to_ragged(ragged) is ragged
    assert [v.name for v in ragged.inputs][:3] == ["ids", "pos", "token_slots"]
    assert not any(n.op in DENSE_ONLY_OPS for n in ragged.prologue)
    attention = [n for n in ragged.block.nodes if n.op == "attention"]
    assert attention and all(n.attrs["ragged"] and len(n.inputs) == 11 for n in attention)
    assert ragged.values["logits"].shape == ("E", 1, graph.meta["spec"]["vocab_size"])
    mixed = copy.deepcopy(ragged)
    mixed.meta["step"] = "dense"
    with pytest.raises(IRError, match="other step form"):
        verify(mixed)


def test_graph_and_spec_round_trip_through_json(graph):
    from linnet_core.models.spec import ModelSpec

    for g in (graph, to_ragged(graph)):
        written = json.loads(json.dumps(g.to_json()))
        again = Graph.from_json(written)
        assert json.loads(json.dumps(again.to_json())) == written
        assert again.ragged == g.ragged
    d = graph.meta["spec"]
    assert ModelSpec.from_json(d).to_json() == d


def test_stablehlo_loads_the_compiled_graph(checkpoints, tmp_path):
    """What was compiled is what is loaded: the loader reads graph.json, never rebuilds it."""
    pytest.importorskip("jax")
    from linnet_core.compile import compile_model

    compiled = compile_model(checkpoints["llama-gqa-untied"], "stablehlo", "float32", 24)
    artifact = tmp_path / "artifact"
    shutil.copytree(compiled.artifact, artifact)
    written = json.loads((artifact / "graph.json").read_text())
    written["meta"]["marker"] = "from graph.json"  # a rebuilt graph would not carry it
    (artifact / "graph.json").write_text(json.dumps(written))
    session = get_backend("stablehlo").load(artifact, rows=1)
    assert session.graph.meta["marker"] == "from graph.json"


# -- defects found reading the code ---------------------------------------------------------------
def test_torch_argmax_takes_the_real_last_position(graph, tmp_path):
    """A padded prompt with all logits: the next token comes from `last`, not the bucket's end."""
    from linnet_core.backends.torch_emit import emit

    path = tmp_path / "model.py"
    path.write_text(emit(graph))
    module = import_generated(path, "linnet_test")
    torch.manual_seed(0)
    weights = {"global": {}, "layers": [{} for _ in range(graph.block.count)]}
    for full, p, layer in graph.all_params():
        local = full if layer is None else full.split(".", 2)[2]
        (weights["global"] if layer is None else weights["layers"][layer])[local] = torch.randn(p.shape)
    c = graph.cache
    cache = torch.zeros(c.layers, 1, c.kv_heads, 16, c.head_dim)
    ids = torch.tensor([[3, 5, 7, 0, 0]])  # three real tokens, padded to five
    last = torch.tensor([2])
    token, logits = module.step(weights, ids, torch.tensor([0]), torch.tensor([0]), last, 5, cache, cache.clone(),
                                True)
    assert int(token[0]) == int(logits[0, 2].argmax())


def test_op_attributes_have_no_hidden_defaults():
    """Defaults live in OpDef.defaults, where infer applies them; a Python default would never be used."""
    for name, d in OPS.items():
        params = inspect.signature(d.infer).parameters
        hidden = [a for a in d.attrs if a in params and params[a].default is not inspect.Parameter.empty]
        assert not hidden, f"{name}: attribute(s) {hidden} default in the shape rule, not in OpDef.defaults"


def test_verifier_checks_recorded_dtypes(graph):
    g = copy.deepcopy(graph)
    g.values["logits"].dtype = "i64"
    with pytest.raises(IRError, match="recorded dtype of 'logits'"):
        verify(g)
    g = copy.deepcopy(graph)
    g.values["ids"].dtype = "act"
    with pytest.raises(IRError, match="graph input 'ids'"):
        verify(g)


def test_rope_refuses_an_unknown_type_as_an_ir_error():
    from linnet_core.ir.rope import inv_freq

    with pytest.raises(IRError, match="reached the emitter unchecked"):
        inv_freq({"type": "yarn", "theta": 1e4}, 8)


def test_errors_say_which_kinds_are_bugs():
    assert IRError.bug and IRError("x").bug
    assert not [cls for cls in LinnetError.__subclasses__() if cls is not IRError and cls.bug]
    assert "never a bug" not in (LinnetError.__doc__ or "")


def test_verify_refuses_a_broken_tokenizer_and_ids_outside_the_vocabulary(tokenized_checkpoints, tmp_path):
    from linnet_core.check.prompts import prompt_ids
    from linnet_core.compile import open_model

    broken = tmp_path / "broken"
    shutil.copytree(tokenized_checkpoints["llama-gqa-untied"], broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer"):
        prompt_ids(open_model(broken), None)
    small = tmp_path / "small-vocab"
    shutil.copytree(tokenized_checkpoints["llama-gqa-untied"], small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 40  # the tokenizer still gives ids up to 383
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not have"):
        prompt_ids(open_model(small), "The quick brown fox")


def test_weight_map_outside_the_roles_is_refused(checkpoints):
    spec = load_spec(checkpoints["llama-gqa-untied"])
    from linnet_core.models import weight_names

    names = weight_names(spec)
    check_weight_map(spec, names)
    with pytest.raises(IRError, match="does not know: attn_fancy.weight"):
        check_weight_map(spec, {**names, "attn_fancy.weight": "x"})
    with pytest.raises(IRError, match="lacks"):
        check_weight_map(spec, {k: v for k, v in names.items() if k != "attn_k.weight"})


@pytest.mark.slow
def test_two_inductor_artifacts_in_one_process_keep_their_own_caches(checkpoints):
    """Each inductor session compiles into its own artifact's cache folder, whichever loaded last."""
    from linnet_core.compile import compile_model

    first = compile_model(checkpoints["llama-gqa-untied"], "inductor", "float32", 40)
    second = compile_model(checkpoints["qwen2-bias-tied"], "inductor", "float32", 40)
    a = get_backend("inductor").load(first.artifact, rows=1)
    get_backend("inductor").load(second.artifact, rows=1)  # loaded last
    before = {p for p in (second.artifact / "inductor_cache").rglob("*") if p.is_file()}
    own_before = sum(1 for p in (first.artifact / "inductor_cache").rglob("*") if p.is_file())
    a.prefill(list(range(1, 20)))  # a new bucket (32 tokens): compiled now, by the first session
    after = {p for p in (second.artifact / "inductor_cache").rglob("*") if p.is_file()}
    assert after == before, "the first session wrote into the second artifact's cache"
    assert sum(1 for p in (first.artifact / "inductor_cache").rglob("*") if p.is_file()) > own_before
    assert np.isfinite(a.prefill([1, 2, 3], logits="last").logits).all()
