"""Per-op conformance: every IR op, run on its own through every emitter, against its numpy
reference (ir.numpy_ops). Odd sizes, grouped-query attention, a window shorter than the step,
stale cache entries, and the ragged step's mixed rows; a failure names the op and the emitter."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import asdict, dataclass

import numpy as np
import pytest
import torch

from linnet_core.ir.graph import Block, CacheLayout, Graph, Node, Value
from linnet_core.ir.ops import OPS, infer
from linnet_core.ir.rope import inv_freq
from linnet_core.models.spec import RopeSpec
from linnet_core.runtime.ragged import ragged_layout

HAVE_JAX = importlib.util.find_spec("jax") is not None
HAVE_ORT = importlib.util.find_spec("onnxruntime") is not None
B, T, H, KV, D, S, ROWS, V = 2, 5, 4, 2, 6, 16, 4, 11  # odd sizes; 4 query heads over 2 KV heads
RNG = np.random.default_rng(7)
START = np.array([2, 6])
SLOTS = np.array([3, 0])
POS = START[:, None] + np.arange(T)  # [B, T]


def floats(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@dataclass
class OpCase:
    id: str
    op: str
    inputs: list  # (name, symbolic shape, array)
    attrs: dict
    ragged: bool = False

    @property
    def node(self) -> Node:
        outs = infer(self.op, [s for _, s, _ in self.inputs], self.attrs)
        return Node(self.op, tuple(n for n, _, _ in self.inputs), tuple(f"y{i}" for i in range(len(outs))),
                    dict(self.attrs))

    def values(self) -> dict[str, Value]:
        vals = {n: Value(n, tuple(s), "i64" if a.dtype.kind == "i" else "act") for n, s, a in self.inputs}
        outs = infer(self.op, [s for _, s, _ in self.inputs], self.attrs)
        vals.update({f"y{i}": Value(f"y{i}", tuple(s), OPS[self.op].out_dtype) for i, s in enumerate(outs)})
        return vals

    @property
    def needs_cache(self) -> bool:
        return self.op == "attention"


CACHE = floats(1, ROWS, KV, S, D)  # stale entries everywhere: the mask must hide them
LAYOUT = ragged_layout([[5], [7], [1, 2, 3], [4, 5]], [3, 9, 2, 0], [1, 3, 0, 2])  # 2 decode rows, 2 chunks
N = len(LAYOUT.ids)


def _ragged_index() -> list:
    shapes = {"pos": (1, "N"), "token_slots": (1, "N"), "d_slots": ("Bd",), "d_kv_len": (1,), "p_slots": ("Bp",),
              "p_index": ("Bp", "Tp"), "p_pack": ("Np",), "p_kv_len": (1,)}
    inputs = LAYOUT.inputs()
    return [(name, shape, np.array(inputs[name][0], dtype=np.int64).reshape(inputs[name][1]))
            for name, shape in shapes.items()]


def _cases() -> list[OpCase]:
    bt = ("B", "T")
    rope_default = asdict(RopeSpec())
    rope_llama3 = asdict(RopeSpec(type="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=8))
    cos, sin = (np.asarray(a, dtype=np.float32) for a in OPS["rope_table"].reference(
        POS, rope=rope_default, rotary_dim=6))
    attention_dense = [("q", (*bt, H, D), floats(B, T, H, D)), ("k", (*bt, KV, D), floats(B, T, KV, D)),
                       ("v", (*bt, KV, D), floats(B, T, KV, D)), ("pos", bt, POS), ("slots", ("B",), SLOTS)]
    ragged_index = _ragged_index()
    ties = floats(B, T, 5)
    ties[0, 0] = [0.5, 1.0, 1.0, -2.0, 1.0]  # three experts tie for the top: the lower ones are taken
    experts_dense, experts_unchosen, experts_ragged = (_experts_inputs(*lead, top_k=k, unchosen=u)
                                                       for lead, k, u in (((B, T), 2, None), ((B, T), 1, 3),
                                                                          ((1, "N"), 2, 0)))
    attention_ragged = [("q", (1, "N", H, D), floats(1, N, H, D)), ("k", (1, "N", KV, D), floats(1, N, KV, D)),
                        ("v", (1, "N", KV, D), floats(1, N, KV, D)), *ragged_index[:2], *ragged_index[2:]]
    return [
        OpCase("positions", "positions", [("start", ("B",), START), ("ids", bt, np.zeros((B, T), np.int64))], {}),
        OpCase("rope_table", "rope_table", [("pos", bt, POS)], {"rope": rope_default, "rotary_dim": 6}),
        OpCase("rope_table-llama3", "rope_table", [("pos", bt, POS)], {"rope": rope_llama3, "rotary_dim": 8}),
        OpCase("embedding", "embedding", [("ids", bt, RNG.integers(0, V, (B, T))), ("table", (V, 7), floats(V, 7))], {}),
        OpCase("rms_norm", "rms_norm", [("x", (*bt, 7), floats(B, T, 7)), ("w", (7,), floats(7))], {"eps": 1e-5}),
        OpCase("rms_norm-heads", "rms_norm", [("x", (*bt, 3, 5), floats(B, T, 3, 5)), ("w", (5,), floats(5))],
               {"eps": 1e-6}),
        OpCase("linear", "linear", [("x", (*bt, 7), floats(B, T, 7)), ("w", (5, 7), floats(5, 7))], {}),
        OpCase("linear-bias", "linear", [("x", (*bt, 7), floats(B, T, 7)), ("w", (5, 7), floats(5, 7)),
                                         ("bias", (5,), floats(5))], {}),
        OpCase("split", "split", [("x", (*bt, 9), floats(B, T, 9))], {"sizes": [2, 3, 4]}),
        OpCase("reshape", "reshape", [("x", (*bt, 12), floats(B, T, 12))], {"shape": ["B", "T", 3, 4]}),
        OpCase("rope-partial", "rope", [("x", (*bt, 3, 10), floats(B, T, 3, 10)), ("cos", (*bt, 6), cos),
                                        ("sin", (*bt, 6), sin)], {}),
        OpCase("rope-full", "rope", [("x", (*bt, 3, 6), floats(B, T, 3, 6)), ("cos", (*bt, 6), cos),
                                     ("sin", (*bt, 6), sin)], {}),
        OpCase("rope-skipped", "rope", [("x", (*bt, 3, 6), floats(B, T, 3, 6)), ("cos", (*bt, 6), cos),
                                        ("sin", (*bt, 6), sin)], {"apply": False}),  # a NoPE layer
        OpCase("attention-gqa-window", "attention", attention_dense, {"scale": 0.4, "window": 3}),
        OpCase("attention-gqa", "attention", attention_dense, {"scale": 0.4, "window": None}),
        OpCase("attention-softcap-window", "attention", attention_dense, {"scale": 0.9, "window": 3, "softcap": 1.5}),
        OpCase("attention-ragged-softcap", "attention", attention_ragged,
               {"scale": 0.9, "window": None, "softcap": 1.5, "ragged": True}, ragged=True),
        OpCase("attention-ragged-window", "attention", attention_ragged,
               {"scale": 0.4, "window": 3, "ragged": True}, ragged=True),
        OpCase("silu", "silu", [("x", (*bt, 7), floats(B, T, 7))], {}),
        OpCase("gelu", "gelu", [("x", (*bt, 7), floats(B, T, 7))], {"approximate": "none"}),
        OpCase("gelu-tanh", "gelu", [("x", (*bt, 7), floats(B, T, 7))], {"approximate": "tanh"}),
        OpCase("mul", "mul", [("a", (*bt, 7), floats(B, T, 7)), ("b", (*bt, 7), floats(B, T, 7))], {}),
        OpCase("scale", "scale", [("x", (*bt, 7), floats(B, T, 7))], {"factor": 0.22}),
        OpCase("softcap", "softcap", [("x", (*bt, 7), floats(B, T, 7) * 4)], {"cap": 1.5}),
        OpCase("pick", "pick", [("a", (*bt, 7), floats(B, T, 7)), ("b", (*bt, 7), floats(B, T, 7))], {"index": 1}),
        OpCase("add", "add", [("a", (*bt, 7), floats(B, T, 7)), ("b", (*bt, 7), floats(B, T, 7))], {}),
        OpCase("route-top2-normalized", "route", [("logits", (*bt, 5), ties)], {"top_k": 2, "normalize": True}),
        OpCase("route-top1", "route", [("logits", (*bt, 5), floats(B, T, 5))], {"top_k": 1, "normalize": False}),
        OpCase("route-top3-ragged", "route", [("logits", (1, "N", 5), floats(1, N, 5))],
               {"top_k": 3, "normalize": False}, ragged=True),
        OpCase("experts-top2", "experts", experts_dense, {"top_k": 2, "act": "silu"}),
        OpCase("experts-top1-one-unchosen", "experts", experts_unchosen, {"top_k": 1, "act": "gelu_tanh"}),
        OpCase("experts-ragged", "experts", experts_ragged, {"top_k": 2, "act": "silu"}, ragged=True),
        OpCase("last_token", "last_token", [("x", (*bt, 7), floats(B, T, 7))], {}),
        OpCase("last_token-ragged", "last_token", [("x", (1, "N", 7), floats(1, N, 7)),
                                                   ("logits_index", ("E",), np.array(LAYOUT.logits_index))],
               {"ragged": True}, ragged=True),
        OpCase("argmax", "argmax", [("logits", ("B", "T'", V), floats(B, 1, V))], {}),
    ]


EXPERTS, EXPERT_WIDTH, EXPERT_IN = 5, 6, 8  # an odd expert count


def _experts_inputs(b, t, *, top_k: int, unchosen: int | None) -> list:
    """experts' inputs over [b, t] tokens: each token's weights as the router gives them, the expert
    `unchosen` chosen by no token."""
    rows = b * (N if t == "N" else t)
    logits = floats(rows, EXPERTS)
    if unchosen is not None:
        logits[:, unchosen] = -30.0
    weights = np.asarray(OPS["route"].reference(logits, top_k=top_k, normalize=True), dtype=np.float32)
    lead = (b, t)
    shape = (b, N if t == "N" else t)
    return [("x", (*lead, EXPERT_IN), floats(*shape, EXPERT_IN)),
            ("weights", (*lead, EXPERTS), weights.reshape(*shape, EXPERTS)),
            ("gate", (EXPERTS * EXPERT_WIDTH, EXPERT_IN), floats(EXPERTS * EXPERT_WIDTH, EXPERT_IN)),
            ("up", (EXPERTS * EXPERT_WIDTH, EXPERT_IN), floats(EXPERTS * EXPERT_WIDTH, EXPERT_IN)),
            ("down", (EXPERTS * EXPERT_IN, EXPERT_WIDTH), floats(EXPERTS * EXPERT_IN, EXPERT_WIDTH))]


CASES = _cases()
FRAME = {"all_logits": False, "last": np.full(B, T - 1)}


def reference(case: OpCase) -> list[np.ndarray]:
    args = [a for _, _, a in case.inputs]
    extra = {}
    if case.needs_cache:
        extra = {"k_cache": CACHE, "v_cache": CACHE * 0.5, "layer": 0}
    elif case.op in ("last_token", "argmax") and not case.ragged:
        extra = FRAME
    attrs = {**OPS[case.op].defaults, **case.attrs}
    out = OPS[case.op].reference(*args, **attrs, **extra)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def kv_len(case: OpCase) -> int:
    return int(POS.max()) + 1


# -- runners: one op through one emitter ---------------------------------------------------------
def run_python(case: OpCase, dialect, xp) -> list[np.ndarray]:
    from linnet_core.backends.pyemit import render_node

    ns: dict = {}
    exec(dialect.prelude, ns)
    is_torch = xp is torch
    index = torch.int64 if is_torch else np.int32

    def arr(a):
        if a.dtype.kind == "i":
            return torch.from_numpy(a.astype(np.int64)) if is_torch else xp.asarray(a.astype(index))
        return torch.from_numpy(a.copy()) if is_torch else xp.asarray(a)

    for name, _, a in case.inputs:
        ns[name] = int(a[0]) if case.ragged and name.endswith("kv_len") else arr(a)
    ns.update(B=B, T=T, N=N, i=0, all_logits=False, last=arr(FRAME["last"]), kv_len=kv_len(case),
              dtype=torch.float32 if is_torch else xp.float32, k_cache=arr(CACHE), v_cache=arr(CACHE * 0.5))
    ns.setdefault("ids", arr(np.zeros((B, T), np.int64)))
    ns.setdefault("kernels", None)  # no runtime kernels here: the ops as emitted
    if case.op == "rope_table":
        freqs = inv_freq(case.attrs["rope"], case.attrs["rotary_dim"])
        ns["ROPE_INV_FREQ"] = torch.tensor(freqs) if is_torch else xp.array(freqs, dtype=xp.float32)
    exec(render_node(case.node, dialect), ns)
    outs = [ns[o] for o in case.node.outputs] + ([ns["k_cache"], ns["v_cache"]] if case.needs_cache else [])
    return [np.asarray(o.float() if is_torch and o.is_floating_point() else o) for o in outs]


def one_node_graph(case: OpCase) -> Graph:
    return Graph(inputs=[], params={}, prologue=[], block=Block(1, "x", "x", {}, [case.node], {}), epilogue=[],
                 outputs=(), values=case.values(), cache=CacheLayout(1, KV, D),
                 meta={"step": "ragged" if case.ragged else "dense"})


def run_onnx(case: OpCase) -> list[np.ndarray]:
    import onnxruntime as ort
    from onnx import helper

    from linnet_core.backends.onnx_emit import IR_VERSION, LOWERINGS, OPSET, OnnxGraphBuilder, _Lowering

    b = OnnxGraphBuilder("float32")
    L = _Lowering(one_node_graph(case), b, "float32", S)
    L.layer = 0
    feeds = {name: (a.astype(np.int64) if a.dtype.kind == "i" else a) for name, _, a in case.inputs}
    if case.op == "linear":  # the ONNX artifact stores linear weights transposed, [in, out]
        feeds["w"] = np.ascontiguousarray(feeds["w"].T)
    if case.op == "experts":  # and the experts' stacks likewise
        L.shapes.update({name: feeds[name].shape for name in ("gate", "up", "down")})
        feeds.update({name: np.ascontiguousarray(feeds[name].T) for name in ("gate", "up", "down")})
    if case.needs_cache:
        feeds.update({"k_cache.0": CACHE[0], "v_cache.0": CACHE[0] * 0.5, "kv_len": np.array([kv_len(case)])})
    if case.op == "last_token" and not case.ragged:
        feeds["logits_from"] = np.array([T - 1])
    b._names.update(feeds)
    L.env.update({name: name for name in feeds})
    lowered = LOWERINGS[case.op](L, case.node, list(feeds)[:len(case.inputs)])
    if case.needs_cache:
        lowered += ["k_cache_out.0", "v_cache_out.0"]
    out_names = [f"out{i}" for i in range(len(lowered))]
    b.nodes += [helper.make_node("Identity", [x], [o]) for x, o in zip(lowered, out_names)]
    elem = 7 if OPS[case.op].out_dtype == "i64" else 1
    graph = helper.make_graph(
        b.nodes, "one_op",
        [helper.make_tensor_value_info(n, 7 if a.dtype.kind == "i" else 1, list(a.shape)) for n, a in feeds.items()],
        [helper.make_tensor_value_info(o, elem if i < len(case.node.outputs) else 1, None)
         for i, o in enumerate(out_names)],
        initializer=b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = sess.run(out_names, feeds)
    # the ONNX graphs hold one cache per layer: [rows, KV, S, D] for this op's layer 0
    return outs[:-2] + [c[None] for c in outs[-2:]] if case.needs_cache else outs


def run_stablehlo(case: OpCase) -> list[np.ndarray]:
    import jax
    from jax._src.lib import xla_client as xc
    from jax.extend.backend import get_backend

    from linnet_core.backends.stablehlo_emit import LOWERINGS, Module, V, _Lowering

    m = Module("f32")
    L = _Lowering(one_node_graph(case), m, "f32", B, T, all_logits=False)
    L.layer = 0
    args, decls = [], []
    for k, (name, _, a) in enumerate(case.inputs):
        a = a.astype(np.int32) if a.dtype.kind == "i" else a
        L.env[name] = V(f"%a{k}", a.shape, "i32" if a.dtype.kind == "i" else "f32")
        args.append(a)
        decls.append(f"{L.env[name].name}: {L.env[name].ty}")
    L.k_cache, L.v_cache = V("%k_cache", CACHE.shape, "f32"), V("%v_cache", CACHE.shape, "f32")
    L.last = V("%last", (B,), "i32")
    args += [CACHE, CACHE * 0.5, FRAME["last"].astype(np.int32)]
    decls += [f"%k_cache: {L.k_cache.ty}", f"%v_cache: {L.v_cache.ty}", f"%last: {L.last.ty}"]
    results = LOWERINGS[case.op](L, case.node, [L.env[n] for n, _, _ in case.inputs])
    if case.needs_cache:
        results += [L.k_cache, L.v_cache]
    text = "\n".join([
        "module @one_op {",
        f"  func.func public @main({', '.join(decls)}) -> ({', '.join(r.ty for r in results)}) {{",
        *m.lines,
        f"    \"func.return\"({', '.join(r.name for r in results)}) : ({', '.join(r.ty for r in results)}) -> ()",
        "  }", "}"])
    exe = get_backend("cpu").compile_and_load(text, xc.DeviceList(tuple(jax.devices("cpu")[:1])), xc.CompileOptions())
    outs = exe.execute_sharded([jax.device_put(a) for a in args]).disassemble_into_single_device_arrays()
    return [np.asarray(o[0]) for o in outs]


def _emitters():
    from linnet_core.backends.torch_emit import TORCH, TORCH_RAGGED

    out = {"torch": (False, lambda c: run_python(c, TORCH, torch)),
           "torch-ragged": (True, lambda c: run_python(c, TORCH_RAGGED, torch))}
    if HAVE_JAX:
        import jax.numpy as jnp

        from linnet_core.backends.jax_emit import JAX

        out["jax"] = (False, lambda c: run_python(c, JAX, jnp))
        out["stablehlo"] = (False, run_stablehlo)
    if HAVE_ORT:
        out["onnx"] = (None, run_onnx)  # both step forms
    return out


EMITTERS = _emitters()
PAIRS = [(c, e) for c in CASES for e, (form, _) in EMITTERS.items()
         if form is None or form == c.ragged]


def test_every_op_has_cases():
    assert {c.op for c in CASES} == set(OPS)


@pytest.mark.parametrize("case,emitter", PAIRS, ids=[f"{c.id}-{e}" for c, e in PAIRS])
def test_op_matches_its_numpy_reference(case, emitter):
    want = reference(case)
    got = EMITTERS[emitter][1](copy.deepcopy(case))
    assert len(got) == len(want), f"{case.op} on {emitter}: {len(got)} outputs, the reference has {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{case.op} on {emitter}: output {k} shape {g.shape}, reference {w.shape}"
        if w.dtype.kind in "iu":
            assert (g == w).all(), f"{case.op} on {emitter}: output {k} differs from the reference"
        else:
            err = float(np.abs(g.astype(np.float64) - w).max())
            assert err < 1e-4 * max(1.0, float(np.abs(w).max())), f"{case.op} on {emitter}: output {k} off by {err:.3g}"
