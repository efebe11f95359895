"""The pre-norm decoder every supported family shares, built into the Linnet IR from a ModelSpec.

A family contributes its config reading and a weight map: Linnet's tensor roles (GGUF-style
names such as `attn_q.weight`, the closed sets below) to checkpoint names. The roles it maps are
the one source of the graph's shape where checkpoints differ (a fused `attn_qkv` or separate
q/k/v; q/k norms; biases); `check_weight_map` refuses a map outside the sets or missing a part.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import IRError
from ..ir.builder import GraphBuilder
from ..ir.graph import CacheLayout, Graph, LayerAttr
from .spec import ModelSpec


@dataclass(frozen=True)
class GgufLayout:
    """How llama.cpp names and lays out a family: its architecture key, and what differs from the IR.

    `rope_interleaved`: llama.cpp rotates adjacent pairs where the checkpoint rotates halves, so
    q/k rows are permuted on the way out. `renames` maps IR roles to llama.cpp's where they differ.
    `name_needs_tokens`: a `general.name` containing one of these words makes llama.cpp demand
    the listed special tokens, so the name is left out when the vocabulary lacks them.
    `config_keys`: llama.cpp's number keys (after `{arch}.`) that carry config.json fields, both ways.
    `no_rope_every`: llama.cpp skips rope on every n-th layer of this architecture (its NoPE layers are
    fixed, not read from the file); 0 where it never does.
    `moe_model_type`: the Hugging Face model_type of this architecture's files that hold experts (llama.cpp
    writes Mixtral as `llama`); None where it is the family's own.
    `sliding_every`: llama.cpp slides the file's window on every layer but each n-th (its pattern is
    fixed too); 0 where one window, if any, covers every layer. `sliding_rope_theta`: the rope base
    llama.cpp gives those sliding layers, where theirs is their own.
    """

    arch: str
    rope_interleaved: bool = False
    renames: dict[str, str] = field(default_factory=dict)
    name_needs_tokens: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    config_keys: dict[str, str] = field(default_factory=dict)
    no_rope_every: int = 0
    sliding_every: int = 0
    sliding_rope_theta: float | None = None
    moe_model_type: str | None = None

    def no_rope_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers llama.cpp runs without rope."""
        return tuple(i for i in range(num_layers) if self.no_rope_every and (i + 1) % self.no_rope_every == 0)

    def sliding_layers(self, num_layers: int) -> tuple[bool, ...]:
        """Which layers llama.cpp slides the window on (every one, where it has no pattern)."""
        return tuple(not self.sliding_every or (i + 1) % self.sliding_every != 0 for i in range(num_layers))


GLOBAL_ROLES = ("token_embd.weight", "output_norm.weight", "output.weight")  # output: absent when tied
# A mixture of experts: the router, and each expert's matrices (names hold `{e}`; stacked by rows)
EXPERT_ROLES = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
BLOCK_ROLES = (
    "attn_norm.weight",
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight",
    "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_qkv.bias",
    "attn_q_norm.weight", "attn_k_norm.weight",
    "attn_output.weight", "attn_output.bias", "post_attention_norm.weight",
    "ffn_norm.weight", "post_ffw_norm.weight",
    "ffn_gate.weight", "ffn_up.weight", "ffn_gate_up.weight", "ffn_down.weight",
    "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias", *EXPERT_ROLES,
)


# Parts every decoder has, and the alternatives of which one must be mapped (fused or separate).
# Each branch's norms are its own: before it (`attn_norm`, `ffn_norm`), after it (`post_*`), or both.
REQUIRED_ROLES = ("token_embd.weight", "output_norm.weight", "attn_output.weight")
ALTERNATIVE_ROLES = ((("attn_qkv.weight",), ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
                     (("ffn_gate_up.weight", "ffn_down.weight"),  # the MLP: fused, separate, or experts
                      ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"), EXPERT_ROLES),
                     ((), ("attn_q_norm.weight", "attn_k_norm.weight")))  # q/k norms: none, or both


def check_weight_map(spec: ModelSpec, names: dict[str, str]) -> None:
    """A family's weight map uses only known roles, names every part, and agrees with the spec."""
    unknown = sorted(set(names) - set(GLOBAL_ROLES) - set(BLOCK_ROLES))
    if unknown:
        raise IRError(f"{spec.family}: weight map has roles Linnet does not know: {', '.join(unknown)}")
    missing = [r for r in REQUIRED_ROLES if r not in names]
    if not spec.tie_word_embeddings and "output.weight" not in names:
        missing.append("output.weight")
    for options in ALTERNATIVE_ROLES:
        present = {r for option in options for r in option if r in names}
        if present not in [set(option) for option in options]:
            missing.append(" or ".join("+".join(g) if g else "none" for g in options))
    for pre, post in (("attn_norm.weight", "post_attention_norm.weight"), ("ffn_norm.weight", "post_ffw_norm.weight")):
        if pre not in names and post not in names:
            missing.append(f"{pre} or {post}")
    if missing:
        raise IRError(f"{spec.family}: weight map lacks {'; '.join(missing)}")
    if ("attn_q_norm.weight" in names) != spec.qk_norm:
        raise IRError(f"{spec.family}: weight map and spec disagree on q/k norms")
    if ("ffn_gate_exps.weight" in names) != bool(spec.num_experts):
        raise IRError(f"{spec.family}: weight map and spec disagree on experts")


def build_decoder(spec: ModelSpec, names: dict[str, str]) -> Graph:
    """The step graph of a pre-norm decoder; `names` maps roles to checkpoint tensor names."""
    check_weight_map(spec, names)
    H, V, L = spec.hidden_size, spec.vocab_size, spec.num_layers
    nh, kvh, hd, ff = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    b = GraphBuilder(meta={"model_type": spec.model_type, "family": spec.family, "spec": spec.to_json()})

    ids = b.input("ids", ("B", "T"), "i64")
    start = b.input("start", ("B",), "i64")
    slots = b.input("slots", ("B",), "i64")
    pos = b.op("positions", [start, ids], "pos")
    cos, sin = b.op("rope_table", [pos], ["rope_cos", "rope_sin"], rope=asdict(spec.rope), rotary_dim=spec.rotary_dim)
    if spec.sliding_rope is not None:  # a second table, for the sliding-window layers
        cos_sliding, sin_sliding = b.op("rope_table", [pos], ["rope_cos_sliding", "rope_sin_sliding"],
                                        rope=asdict(spec.sliding_rope), rotary_dim=spec.rotary_dim)
    table = b.param("token_embd.weight", (V, H), names["token_embd.weight"])
    x = b.op("embedding", [ids, table], "x")
    if spec.embedding_scale != 1.0:
        x = b.op("scale", [x], "x_scaled", factor=spec.embedding_scale)

    def linear(inp: str, role: str, out_features: int, in_features: int, out: str) -> str:
        w = b.param(f"{role}.weight", (out_features, in_features), names[f"{role}.weight"])
        args = [inp, w]
        if f"{role}.bias" in names:
            args.append(b.param(f"{role}.bias", (out_features,), names[f"{role}.bias"]))
        return b.op("linear", args, out)

    def norm(inp: str, role: str, width: int, out: str) -> str:
        """`inp` normed by the role's weight, or `inp` itself where the family has no such norm."""
        if f"{role}.weight" not in names:
            return inp
        weight = b.param(f"{role}.weight", (width,), names[f"{role}.weight"], offset=spec.norm_weight_offset)
        return b.op("rms_norm", [inp, weight], out, eps=spec.rms_norm_eps)

    def joined(residual: str, branch: str, post_norm: str, out: str) -> str:
        """A branch's output (normed after, where the family does; scaled, where its config says) added
        to the residual stream."""
        branch = norm(branch, post_norm, H, f"{branch}_normed")
        if spec.residual_scale != 1.0:
            branch = b.op("scale", [branch], f"{branch}_scaled", factor=spec.residual_scale)
        return b.op("add", [residual, branch], out)

    def mlp(h2: str) -> str:
        if "ffn_gate_up.weight" in names:
            gu = linear(h2, "ffn_gate_up", 2 * ff, H, "gate_up")
            gate, up = b.op("split", [gu], ["gate", "up"], sizes=[ff, ff])
        else:
            gate = linear(h2, "ffn_gate", ff, H, "gate")
            up = linear(h2, "ffn_up", ff, H, "up")
        if spec.hidden_act == "silu":
            act = b.op("silu", [gate], "act")
        else:
            act = b.op("gelu", [gate], "act", approximate="tanh" if spec.hidden_act.endswith("tanh") else "none")
        m = b.op("mul", [act, up], "ffn_mid")
        return linear(m, "ffn_down", H, ff, "ffn_out")

    rope_layers = {"rope": tuple(i not in spec.no_rope_layers for i in range(L))} if spec.no_rope_layers else {}
    if spec.sliding_rope is not None:
        rope_layers["rope_table"] = tuple(int(w is not None) for w in spec.layer_windows)
    b.begin_block(L, x, window=spec.layer_windows, **rope_layers)
    if spec.sliding_rope is not None:  # each layer's own table, picked first (the attention block reads it)
        cos = b.op("pick", [cos, cos_sliding], "rope_cos_layer", index=LayerAttr("rope_table"))
        sin = b.op("pick", [sin, sin_sliding], "rope_sin_layer", index=LayerAttr("rope_table"))
    h = norm(x, "attn_norm", H, "h")
    if "attn_qkv.weight" in names:
        qkv = linear(h, "attn_qkv", (nh + 2 * kvh) * hd, H, "qkv")
        q, k, v = b.op("split", [qkv], ["q", "k", "v"], sizes=[nh * hd, kvh * hd, kvh * hd])
    else:
        q = linear(h, "attn_q", nh * hd, H, "q")
        k = linear(h, "attn_k", kvh * hd, H, "k")
        v = linear(h, "attn_v", kvh * hd, H, "v")
    if spec.qk_norm_over == "projection":  # one norm over all heads' features, before they are split
        q = norm(q, "attn_q_norm", nh * hd, "q_normed")
        k = norm(k, "attn_k_norm", kvh * hd, "k_normed")
    q = b.op("reshape", [q], "q_heads", shape=["B", "T", nh, hd])
    k = b.op("reshape", [k], "k_heads", shape=["B", "T", kvh, hd])
    v = b.op("reshape", [v], "v_heads", shape=["B", "T", kvh, hd])
    if spec.qk_norm_over == "head":
        q = norm(q, "attn_q_norm", hd, "q_normed")
        k = norm(k, "attn_k_norm", hd, "k_normed")
    rope_gate = {"apply": LayerAttr("rope")} if spec.no_rope_layers else {}
    q = b.op("rope", [q, cos, sin], "q_rot", **rope_gate)
    k = b.op("rope", [k, cos, sin], "k_rot", **rope_gate)
    scale = spec.attention_scale if spec.attention_scale is not None else hd**-0.5
    softcap = {"softcap": spec.attention_softcap} if spec.attention_softcap is not None else {}
    a = b.op("attention", [q, k, v, pos, slots], "attn", scale=scale, window=LayerAttr("window"), **softcap)
    a = b.op("reshape", [a], "attn_flat", shape=["B", "T", nh * hd])
    o = linear(a, "attn_output", H, nh * hd, "attn_out")
    x1 = joined(x, o, "post_attention_norm", "x_attn")
    h2 = norm(x1, "ffn_norm", H, "h_ffn")
    d = mixture_of_experts(b, spec, names, h2) if spec.num_experts else mlp(h2)
    x = b.end_block(joined(x1, d, "post_ffw_norm", "x_out"))

    last = b.op("last_token", [x], "x_last")
    normed = norm(last, "output_norm", H, "x_final")
    # A tied head is its own param over the same tensor: the artifact stores it once, and each
    # use keeps its own layout (a gather table for the embedding, a packed matrix for the head).
    head_source = names["token_embd.weight" if spec.tie_word_embeddings else "output.weight"]
    logits = b.op("linear", [normed, b.param("output.weight", (V, H), head_source)], "logits")
    if spec.logit_scale != 1.0:
        logits = b.op("scale", [logits], "logits_scaled", factor=spec.logit_scale)
    if spec.logit_softcap is not None:
        logits = b.op("softcap", [logits], "logits_capped", cap=spec.logit_softcap)
    nxt = b.op("argmax", [logits], "next_token")
    return b.finish((nxt, logits), CacheLayout(L, kvh, hd))


EXPERT_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def mixture_of_experts(b: GraphBuilder, spec: ModelSpec, names: dict[str, str], h: str) -> str:
    """The MLP as experts: a router's top-k of them per token, each expert's matrices one param of all
    experts' stacked by rows (expert e's rows are a contiguous slice: a CPU kernel reads only those)."""
    H, E, F = spec.hidden_size, spec.num_experts, spec.expert_intermediate_size

    def stacked(role: str, rows: int, cols: int) -> str:
        parts = [names[role].format(i="{i}", e=e) for e in range(E)]
        return b.param(role, (E * rows, cols), *parts)

    router = b.param("ffn_gate_inp.weight", (E, H), names["ffn_gate_inp.weight"])
    logits = b.op("linear", [h, router], "router_logits")
    weights = b.op("route", [logits], "expert_weights", top_k=spec.experts_per_token,
                   normalize=spec.normalize_expert_weights)
    gate, up = stacked("ffn_gate_exps.weight", F, H), stacked("ffn_up_exps.weight", F, H)
    down = stacked("ffn_down_exps.weight", H, F)
    return b.op("experts", [h, weights, gate, up, down], "ffn_out", top_k=spec.experts_per_token,
                act=EXPERT_ACTIVATIONS[spec.hidden_act])


def with_experts(names: dict[str, str], prefix: str, gate: str, up: str, down: str, router: str) -> dict[str, str]:
    """`names` with its dense MLP replaced by experts under `prefix` (`{i}` the layer, `{e}` the expert)."""
    dense = [r for r in names if r.startswith(("ffn_gate.", "ffn_up.", "ffn_gate_up.", "ffn_down."))]
    return {**{r: n for r, n in names.items() if r not in dense},
            "ffn_gate_inp.weight": f"{prefix}.{router}.weight",
            "ffn_gate_exps.weight": f"{prefix}.experts.{{e}}.{gate}.weight",
            "ffn_up_exps.weight": f"{prefix}.experts.{{e}}.{up}.weight",
            "ffn_down_exps.weight": f"{prefix}.experts.{{e}}.{down}.weight"}


def hf_llama_style_names(spec: ModelSpec, *, fused_qkv: bool = False, fused_gate_up: bool = False,
                         qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False,
                         qk_norm: bool = False) -> dict[str, str]:
    """The weight map of the `model.layers.{i}.self_attn.*` / `mlp.*` layout most families share."""
    layer = "model.layers.{i}"
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "attn_norm.weight": f"{layer}.input_layernorm.weight",
        "attn_output.weight": f"{layer}.self_attn.o_proj.weight",
        "ffn_norm.weight": f"{layer}.post_attention_layernorm.weight",
        "ffn_down.weight": f"{layer}.mlp.down_proj.weight",
    }
    if not spec.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    projections = ["qkv"] if fused_qkv else ["q", "k", "v"]
    for p in projections:
        names[f"attn_{p}.weight"] = f"{layer}.self_attn.{p}_proj.weight"
        if qkv_bias:
            names[f"attn_{p}.bias"] = f"{layer}.self_attn.{p}_proj.bias"
    if o_bias:
        names["attn_output.bias"] = f"{layer}.self_attn.o_proj.bias"
    if qk_norm:
        names["attn_q_norm.weight"] = f"{layer}.self_attn.q_norm.weight"
        names["attn_k_norm.weight"] = f"{layer}.self_attn.k_norm.weight"
    mlp = ["gate_up"] if fused_gate_up else ["gate", "up"]
    for p in mlp + ["down"]:
        names[f"ffn_{p}.weight"] = f"{layer}.mlp.{p}_proj.weight"
        if mlp_bias:
            names[f"ffn_{p}.bias"] = f"{layer}.mlp.{p}_proj.bias"
    return names
