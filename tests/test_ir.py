"""The IR: its verifier refuses broken graphs, passes keep meaning, emitters are golden."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from family_fixtures import FAMILY_CASES

from linnet_core.backends.jax_emit import TEMPLATES as JAX_TEMPLATES
from linnet_core.backends.jax_emit import emit as emit_jax
from linnet_core.backends.torch_emit import TEMPLATES, emit
from linnet_core.errors import IRError
from linnet_core.ir.graph import Node
from linnet_core.ir.ops import OPS
from linnet_core.ir.passes import fuse_parallel_linears, optimize
from linnet_core.ir.ragged import to_ragged
from linnet_core.ir.verify import verify
from linnet_core.models import build_graph, load_spec, weight_names

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def graph(checkpoints):
    return build_graph(load_spec(checkpoints["qwen3-headdim128"]))


def test_every_op_has_a_template_in_each_python_dialect():
    assert set(TEMPLATES) == set(OPS) == set(JAX_TEMPLATES)


def test_verifier_accepts_every_family(checkpoints):
    for path in checkpoints.values():
        verify(optimize(build_graph(load_spec(path))))


def _broken(graph, mutate):
    g = copy.deepcopy(graph)
    mutate(g)
    with pytest.raises(IRError) as e:
        verify(g)
    return str(e.value)


def test_verifier_refuses_unknown_op(graph):
    msg = _broken(graph, lambda g: g.block.nodes.insert(0, Node("softmax_fancy", ("x",), ("y",))))
    assert "unknown op" in msg


def test_verifier_refuses_use_before_definition(graph):
    msg = _broken(graph, lambda g: g.block.nodes.reverse())
    assert "before it is defined" in msg


def test_verifier_refuses_a_shape_that_does_not_fit(graph):
    def mutate(g):
        p = g.block.params["attn_q.weight"]
        g.block.params["attn_q.weight"] = type(p)(p.name, (p.shape[0], p.shape[1] + 1), p.parts)

    assert "linear" in _broken(graph, mutate)


def test_verifier_refuses_unused_weight_and_bad_layer_attrs(graph):
    assert "never used" in _broken(graph, lambda g: g.params.update(extra=copy.copy(g.params["output_norm.weight"])))
    assert "per-layer" in _broken(graph, lambda g: g.block.layer_attrs.update(window=(None,)))


def test_emitter_fails_naming_a_missing_template(graph, monkeypatch):
    monkeypatch.delitem(TEMPLATES, "rope")
    with pytest.raises(IRError, match="torch emitter has no template for op 'rope'"):
        emit(graph)


def test_fusion_merges_qkv_and_gate_up(graph):
    fused = fuse_parallel_linears(graph)
    assert {"attn_qkv.weight", "ffn_gate_up.weight"} <= set(fused.block.params)
    assert "attn_q.weight" not in fused.block.params
    assert fused.block.params["attn_qkv.weight"].parts == (
        "model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.v_proj.weight")
    assert sum(n.op == "linear" for n in fused.block.nodes) == 4


EMITTERS = {"torch": emit, "torch-ragged": lambda g: emit(to_ragged(g)), "jax": emit_jax}


@pytest.mark.parametrize("emitter", EMITTERS)
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_emitted_python_matches_golden(case, emitter, checkpoints):
    """A refactor must not change emitted text; LINNET_UPDATE_GOLDEN=1 rewrites the copies."""
    text = EMITTERS[emitter](optimize(build_graph(load_spec(checkpoints[case]))))
    path = GOLDEN / f"{emitter}-{case}.py.txt"
    if os.environ.get("LINNET_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no golden copy at {path}; run with LINNET_UPDATE_GOLDEN=1 once"
    assert text == path.read_text()
    compile(text, str(path), "exec")


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_the_eager_step_calls_each_fused_group_once_a_layer(case, checkpoints):
    """The ragged torch step renders the attention block, silu * up and the residual add + norm as one
    helper call each (torch_groups), for every family; the dense step (inductor's) keeps every line."""
    graph = optimize(build_graph(load_spec(checkpoints[case])))
    ragged = emit(to_ragged(graph))
    loop = ragged[ragged.index("for i, w in enumerate(layers):"):]
    # Patterns no group has stay as lines: q/k norms over the whole projection and soft-capped scores
    # (no attention kernel for them), a gelu MLP, norms after a branch but none before the next.
    spec = load_spec(checkpoints[case])
    # Experts run their activations inside their own call.
    unfused = {"= attention_block(" if spec.qk_norm_over == "projection" or spec.attention_softcap else "",
               "= silu_mul(" if spec.hidden_act != "silu" or spec.num_experts else "",
               "= add_rms_norm(" if "ffn_norm.weight" not in weight_names(spec) else ""} - {""}
    for call in ("= attention_block(", "= silu_mul(", "= add_rms_norm("):
        assert loop.count(call) == (call not in unfused), call
    assert ("ragged_attention(" in loop) == ("= attention_block(" in unfused)
    dense_gelu = spec.hidden_act != "silu" and not spec.num_experts
    assert (".split_with_sizes(" in loop) == ("= attention_block(" in unfused or dense_gelu)
    assert ("= experts(" in loop) == bool(spec.num_experts)
    assert "= attention_block(" not in emit(graph).split("def step(")[1]


def test_a_group_whose_values_are_read_elsewhere_keeps_its_lines(graph):
    """Fusing must not hide a value another node reads: a second reader of silu's output, or of a
    query head, leaves that group's nodes as they are."""
    from linnet_core.backends.torch_groups import Group, groups

    g = to_ragged(optimize(graph))
    helpers = lambda g: {n.helper for n in groups(g) if isinstance(n, Group)}  # noqa: E731
    assert helpers(g) == {"attention_block", "silu_mul", "add_rms_norm"}
    act = next(n for n in g.block.nodes if n.op == "silu").outputs[0]
    q_rot = next(n for n in g.block.nodes if n.op == "rope").outputs[0]
    for value, lost in ((act, "silu_mul"), (q_rot, "attention_block")):
        g2 = copy.deepcopy(g)
        g2.block.nodes.append(Node("add", (value, value), ("extra",)))
        assert helpers(g2) == {"attention_block", "silu_mul", "add_rms_norm"} - {lost}


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_emitted_stablehlo_matches_golden_and_compiles(case, checkpoints):
    """Golden text of one prefill bucket per family; XLA parses and compiles every one."""
    pytest.importorskip("jax")
    import jax
    from jax._src.lib import xla_client as xc
    from jax.extend.backend import get_backend

    from linnet_core.backends.stablehlo_emit import emit_stablehlo

    graph = optimize(build_graph(load_spec(checkpoints[case])))
    text = emit_stablehlo(graph, "float32", 32, rows=2, B=1, T=16, all_logits=False)
    path = GOLDEN / f"stablehlo-{case}.mlir.txt"
    if os.environ.get("LINNET_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.is_file(), f"no golden copy at {path}; run with LINNET_UPDATE_GOLDEN=1 once"
    assert text == path.read_text()
    for dtype, B, T, all_logits in (("bfloat16", 2, 1, False), ("float16", 1, 8, True)):
        other = emit_stablehlo(graph, dtype, 32, rows=2, B=B, T=T, all_logits=all_logits)
        get_backend("cpu").compile_and_load(other, xc.DeviceList(tuple(jax.devices("cpu")[:1])), xc.CompileOptions())


def test_stablehlo_emitter_fails_naming_a_missing_lowering(graph, monkeypatch):
    pytest.importorskip("jax")
    from linnet_core.backends import stablehlo_emit

    monkeypatch.delitem(stablehlo_emit.LOWERINGS, "attention")
    with pytest.raises(IRError, match="StableHLO emitter has no lowering for op 'attention'"):
        stablehlo_emit.emit_stablehlo(graph, "float32", 32, rows=1, B=1, T=1, all_logits=False)


def test_invalid_stablehlo_surfaces_with_xla_diagnostic(checkpoints, monkeypatch):
    pytest.importorskip("jax")
    import linnet_core.backends.stablehlo_backend as shlo
    from linnet_core.compile import compile_model

    real = shlo.emit_stablehlo
    monkeypatch.setattr(shlo, "emit_stablehlo",
                        lambda *a, **k: real(*a, **k).replace('"stablehlo.rsqrt"', '"stablehlo.rsqrtt"'))
    with pytest.raises(IRError, match="XLA refused the emitted StableHLO"):
        compile_model(checkpoints["llama-mha-tied-legacy"], "stablehlo", "float32", 24)
