"""Emitter: Linnet IR -> a readable, self-contained PyTorch module (one line per IR node).

Each op renders through one template in TEMPLATES; an op without a template fails at emit time,
naming it. The layer block becomes a plain `for` loop over per-layer weight dicts. The output is
deterministic, so golden copies of it catch refactors that change what is emitted.
"""

from __future__ import annotations

from .. import __version__
from ..errors import IRError
from ..ir.graph import Graph, LayerAttr, Node
from ..ir.rope import inv_freq
from ..ir.verify import verify

PRELUDE = '''
import torch
import torch.nn.functional as F


def rope_table(pos, inv_freq, dtype):
    """cos, sin [B, T, rot] for positions [B, T]; computed in float32 like transformers."""
    freqs = pos[..., None].float() * inv_freq.to(pos.device)  # [B, T, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, rot]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def linear(x, weight, bias=None):
    """x @ weight.T (+ bias). On CPU the runtime may pre-pack weights for oneDNN's kernel."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def rms_norm(x, weight, eps):
    """x / rms(x) * weight over the last axis; the statistics in float32."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rope(x, cos, sin):
    """Rotate-half rope on the first rot features of each head; x [B, T, heads, D]."""
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, rot]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def attention(q, k, v, pos, slots, kv_len, k_cache, v_cache, window, scale):
    """Write k, v at `pos` of cache rows `slots`, then attend over the first kv_len positions.

    q [B, T, H, D]; k, v [B, T, KV, D]; caches [rows, KV, S, D]; returns [B, T, H, D].
    """
    rows = slots[:, None].expand_as(pos)  # [B, T]
    k_cache[rows, :, pos] = k  # advanced indices first: the target is [B, T, KV, D]
    v_cache[rows, :, pos] = v
    keys = k_cache[:, :, :kv_len].index_select(0, slots)  # [B, KV, kv_len, D]
    values = v_cache[:, :, :kv_len].index_select(0, slots)
    key_pos = torch.arange(kv_len, device=pos.device)  # [kv_len]
    mask = key_pos <= pos[..., None]  # [B, T, kv_len]: causal, and hides stale cache entries
    if window is not None:
        mask = mask & (key_pos > pos[..., None] - window)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # [B, H, T, D]
    return out.transpose(1, 2)
'''


def _shape(s: tuple) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


class _Ctx:
    def __init__(self, g: Graph, in_block: bool):
        self.g, self.in_block = g, in_block

    def ref(self, name: str) -> str:
        if self.in_block and name in self.g.block.params:
            return f'w["{name}"]'
        if name in self.g.params:
            return f'g["{name}"]'
        return name

    @staticmethod
    def attr(v) -> str:
        if isinstance(v, LayerAttr):
            return f"{v.key.upper()}[i]"
        if isinstance(v, list) and any(isinstance(d, str) for d in v):  # a shape with symbols B, T
            return ", ".join(str(d) for d in v)
        return repr(v)


# One template per op: {out} the outputs, {a} {b} the first inputs, {args} all inputs, and
# {<attr>} each attribute (a per-layer one indexes its table with the loop's `i`).
TEMPLATES: dict[str, str] = {
    "positions": "{out} = {a}[:, None] + torch.arange(T, device=ids.device)",
    "rope_table": "{out} = rope_table({a}, ROPE_INV_FREQ, dtype)",
    "embedding": "{out} = F.embedding({a}, {b})",
    "rms_norm": "{out} = rms_norm({a}, {b}, {eps})",
    "linear": "{out} = linear({args})",
    "split": "{out} = {a}.split({sizes}, dim=-1)",
    "reshape": "{out} = {a}.reshape({shape})",
    "rope": "{out} = apply_rope({args})",
    "attention": "{out} = attention({args}, kv_len, k_cache[i], v_cache[i], {window}, {scale})",
    "silu": "{out} = F.silu({a})",
    "gelu": "{out} = F.gelu({a}, approximate={approximate})",
    "mul": "{out} = {a} * {b}",
    "add": "{out} = {a} + {b}",
    "last_token": "{out} = {a} if all_logits else {a}[:, -1:]",
    "argmax": "{out} = {a}[:, -1].argmax(dim=-1)",
}


def _render(n: Node, ctx: _Ctx) -> str:
    template = TEMPLATES.get(n.op)
    if template is None:
        raise IRError(f"the torch emitter has no template for op '{n.op}'")
    refs = [ctx.ref(i) for i in n.inputs]
    return template.format(
        out=", ".join(n.outputs), a=refs[0], b=refs[1] if len(refs) > 1 else "", args=", ".join(refs),
        **{k: ctx.attr(v) for k, v in n.attrs.items()},
    )


def _lines(nodes: list[Node], g: Graph, ctx: _Ctx, indent: str) -> list[str]:
    out = []
    for n in nodes:
        shapes = "; ".join(_shape(g.values[o].shape) for o in n.outputs)
        out.append(f"{indent}{_render(n, ctx)}  # {shapes}")
    return out


def emit(g: Graph) -> str:
    """The module's source text for graph `g` (verified first)."""
    verify(g)
    meta = g.meta
    spec = meta.get("spec", {})
    rope_node = next(n for n in g.prologue if n.op == "rope_table")
    freqs = inv_freq(rope_node.attrs["rope"], rope_node.attrs["rotary_dim"])
    head = [
        f'"""Generated by Linnet {__version__} from the IR of a {meta.get("model_type")} checkpoint '
        f"({g.block.count} layers, hidden {spec.get('hidden_size')}, vocab {spec.get('vocab_size')}).",
        "",
        "step(weights, ids, start, slots, kv_len, k_cache, v_cache, all_logits=False) -> (next_token, logits)",
        "  ids [B, T] int64; start [B] first position of the step per row; slots [B] cache rows;",
        f"  k_cache, v_cache [{g.cache.layers}, rows, {g.cache.kv_heads}, cache_len, {g.cache.head_dim}];"
        " kv_len: positions to attend over.",
        "Regenerated from the IR on every compile: change the emitter, not this file.",
        '"""',
    ]
    body = [PRELUDE.strip("\n"), "", ""]
    rows = [", ".join(repr(float(f)) for f in freqs[k:k + 4]) for k in range(0, len(freqs), 4)]
    body.append(f"ROPE_INV_FREQ = torch.tensor([  # [{len(freqs)}] inverse frequencies, {rope_node.attrs['rope']['type']} rope")
    body += [f"    {r}," for r in rows]
    body.append("], dtype=torch.float32)")
    for key, values in g.block.layer_attrs.items():
        body.append(f"{key.upper()} = {tuple(values)!r}  # per layer")
    body += ["", ""]
    body.append("def step(weights, ids, start, slots, kv_len: int, k_cache, v_cache, all_logits: bool = False):")
    body.append('    g, layers = weights["global"], weights["layers"]')
    body.append("    B, T = ids.shape")
    body.append("    dtype = k_cache.dtype")
    body += _lines(g.prologue, g, _Ctx(g, False), "    ")
    body.append(f"    for i, w in enumerate(layers):")
    body += _lines(g.block.nodes, g, _Ctx(g, True), "        ")
    body.append(f"        {g.block.carry} = {g.block.result}")
    body += _lines(g.epilogue, g, _Ctx(g, False), "    ")
    body.append(f"    return {', '.join(g.outputs)}")
    return "\n".join(head + body) + "\n"
