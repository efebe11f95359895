"""Emitter: Linnet IR -> a readable, self-contained PyTorch module (one line per IR node).

Each op renders through one template in TEMPLATES (see pyemit for the machinery); the layer
block becomes a plain `for` loop over per-layer weight dicts. Two dialects share the prelude:
TORCH renders dense steps (B rows of T tokens; inductor compiles it per bucket) and
TORCH_RAGGED the ragged form of ir.ragged (N tokens from any mix of rows, one call per step).
"""

from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph
from .pyemit import Dialect, emit_module
from .torch_groups import groups

PRELUDE = '''
import torch
import torch.nn.functional as F


def rope_table(pos, inv_freq, dtype):
    """cos, sin [B, T, rot] for positions [B, T]; computed in float32 like transformers."""
    freqs = pos[..., None].float() * inv_freq.to(pos.device)  # [B, T, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, rot]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def linear(x, weight, bias=None):
    """x @ weight.T (+ bias). A weight the runtime packed for this CPU is a callable kernel."""
    if callable(weight):
        return weight(x, bias)
    return F.linear(x, weight, bias)


def embedding(ids, table):
    """Rows `ids` of the token table; a block-quantized table (a callable) dequantizes just those."""
    if callable(table):
        return table(ids)
    return F.embedding(ids, table)


def rms_norm(x, weight, eps, kernels=None):
    """x / rms(x) * weight over the last axis; the statistics in float32.

    `kernels`: the runtime's CPU kernels for a step's small ops (weights["global"]["step_kernels"]),
    or None. Each computes what its helper's lines compute, in one call where they are several.
    """
    if kernels is not None and kernels.rms_norm is not None:
        return kernels.rms_norm(x, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rope(x, cos, sin, kernels=None):
    """Rotate-half rope on the first rot features of each head; x [B, T, heads, D]."""
    if kernels is not None and kernels.rope is not None:
        return kernels.rope(x, cos, sin)
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, rot]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def silu(x, kernels=None):
    """x * sigmoid(x), computed in float32 and rounded once to x's dtype."""
    if kernels is not None and kernels.silu is not None:
        return kernels.silu(x)
    return F.silu(x)


def silu_mul(gate_up, kernels=None):
    """silu(gate) * up, gate and up the two halves of gate_up [..., 2F] -> [..., F]."""
    if kernels is not None and kernels.silu_mul is not None:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate, kernels) * up


def add_rms_norm(x, y, weight, eps, kernels=None):
    """(x + y, its rms_norm): a residual add and the norm after it."""
    if kernels is not None and kernels.add_rms_norm is not None:
        return kernels.add_rms_norm(x, y, weight, eps)
    total = x + y
    return total, rms_norm(total, weight, eps, kernels)


def softcap(x, cap):
    """cap * tanh(x / cap), in float32: values held below cap (Gemma 2's logits)."""
    return (cap * torch.tanh(x.float() / cap)).to(x.dtype)


def route(logits, top_k, normalize):
    """Each expert's weight [..., E]: the softmax of the router's logits in float32, its top_k kept
    (renormalized to sum to 1 where the model does), the rest 0."""
    probs = logits.float().softmax(-1)
    top, index = probs.sort(dim=-1, descending=True, stable=True)  # the lower expert first on ties (topk: any)
    top, index = top[..., :top_k], index[..., :top_k]
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, index, top).to(logits.dtype)


def expert_rows(stack, e, count):
    """Expert e's matrix of a stack [E * rows, in]: its own kernel where the runtime packed one per
    expert (a list), else a view of its rows."""
    if isinstance(stack, list):
        return stack[e]
    rows = stack.shape[0] // count
    return stack[e * rows:(e + 1) * rows]


def experts(x, weights, gate, up, down, top_k, act):
    """x [..., H] through the experts weights [..., E] chose: sum of w * down_e(act(gate_e x) * up_e x).

    On the runtime's CPU kernels (each stack one kernel per expert) the whole op is one C++ call over
    the chosen experts, eager or compiled. Otherwise, eager, only the chosen experts run, each over
    its own tokens (a decode step reads just their weights); traced by a compiler, every expert runs
    over every token, weight 0 where not chosen: shapes that compile whole, at E / top_k times the
    multiplications.
    """
    fused = getattr(gate, "experts", None)
    out = fused(x, weights, up, down, act) if fused is not None else None
    if out is not None:
        return out
    shape, count = x.shape, weights.shape[-1]
    x, weights = x.reshape(-1, shape[-1]), weights.reshape(-1, count)
    out = torch.zeros_like(x)
    if torch.compiler.is_compiling():
        plan = [(e, None) for e in range(count)]
    else:
        tokens, chosen = weights.nonzero(as_tuple=True)
        plan = [(e, tokens[chosen == e]) for e in chosen.unique().tolist()]
    for e, rows in plan:
        xe = x if rows is None else x[rows]
        gated = activation(linear(xe, expert_rows(gate, e, count)), act) * linear(xe, expert_rows(up, e, count))
        ye = linear(gated, expert_rows(down, e, count))
        if rows is None:
            out = out + ye * weights[:, e, None]
        else:
            out.index_add_(0, rows, ye * weights[rows, e, None])
    return out.reshape(shape)


def activation(x, act):
    """The experts' activation by name: silu, gelu, gelu_tanh."""
    if act == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")


def argmax(x, kernels=None):
    """The index of the largest of x [..., V] along V (the first on ties)."""
    if kernels is not None and kernels.argmax is not None:
        return kernels.argmax(x)
    return x.argmax(dim=-1)


def write_cache(k, v, pos, rows, k_cache, v_cache, layer, kernels=None):
    """Write k, v [B, T, KV, D] at positions pos [B, T] of cache rows [B, T] of `layer`.

    The write indexes the whole cache [L, rows, KV, S, D] (no view of it), so a compiler can
    update it in place.
    """
    if kernels is not None and kernels.write_cache is not None:
        return kernels.write_cache(k, v, pos, rows, k_cache, v_cache, layer)
    layers = torch.full_like(pos, layer)  # [B, T]
    k_cache[layers, rows, :, pos] = k.to(k_cache.dtype)  # advanced indices first: the target is [B, T, KV, D]
    v_cache[layers, rows, :, pos] = v.to(v_cache.dtype)


def attention(q, k, v, pos, slots, kv_len, k_cache, v_cache, layer, window, scale, softcap, kernels=None):
    """Write k, v at `pos` of cache rows `slots` of `layer`, then attend over the first kv_len positions.

    q [B, T, H, D]; k, v [B, T, KV, D]; caches [L, rows, KV, S, D]; returns [B, T, H, D].
    """
    write_cache(k, v, pos, slots[:, None].expand_as(pos), k_cache, v_cache, layer, kernels)
    return attend(q, pos, slots, kv_len, k_cache, v_cache, layer, window, scale, q.shape[2] != k.shape[2], kernels,
                  softcap)


def ragged_attention(q, k, v, pos, token_slots, d_slots, d_kv_len, p_slots, p_index, p_pack, p_kv_len,
                     k_cache, v_cache, layer, window, scale, softcap, kernels=None):
    """A ragged step's attention: q [1, N, H, D] of N tokens from many rows, each written at its own
    row and position, then attended in two groups: the first Bd tokens (one-token rows), and the
    chunks gathered into [Bp, Tp] by p_index (padding repeats a chunk's last token) -> [1, N, H, D].
    """
    write_cache(k, v, pos, token_slots, k_cache, v_cache, layer, kernels)
    gqa = q.shape[2] != k.shape[2]
    outs, n_decode = [], d_slots.shape[0]
    if n_decode:  # [1, Bd, H, D] -> [Bd, 1, H, D] and back
        out = attend(q[0, :n_decode, None], pos[0, :n_decode, None], d_slots, d_kv_len,
                     k_cache, v_cache, layer, window, scale, gqa, kernels, softcap)
        outs.append(out[:, 0][None])
    if p_slots.shape[0] == 1 and not n_decode and p_index.shape[1] == q.shape[1]:  # one whole chunk: already [1, N]
        outs.append(attend(q, pos, p_slots, p_kv_len, k_cache, v_cache, layer, window, scale, gqa, softcap=softcap))
    elif p_slots.shape[0]:  # [1, N, H, D] -> [Bp, Tp, H, D] -> [1, Np, H, D]
        out = attend(q[0][p_index], pos[0][p_index], p_slots, p_kv_len, k_cache, v_cache, layer, window, scale, gqa,
                     softcap=softcap)
        outs.append(out.flatten(0, 1)[p_pack][None])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def attention_block(qkv, heads, kv_heads, head_dim, q_norm, k_norm, eps, cos, sin, pos, token_slots, d_slots,
                    d_kv_len, p_slots, p_index, p_pack, p_kv_len, k_cache, v_cache, layer, window, scale, rotate,
                    kernels=None):
    """A ragged step's attention block: qkv [1, N, (H + 2 KV) D] split into heads, q and k normed (where a
    norm weight is given) and rotated (unless `rotate` is false: a NoPE layer), then ragged_attention
    -> [1, N, H D]. One kernel call for a step of one-token rows."""
    if not rotate:  # cos 1 and sin 0 turn rope into x itself, bit for bit, so the kernel serves NoPE layers too
        cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    if kernels is not None and kernels.attention_block is not None and p_slots.shape[0] == 0:
        return kernels.attention_block(qkv, heads, kv_heads, q_norm, k_norm, eps or 0.0, cos, sin, pos, token_slots,
                                       k_cache, v_cache, layer, window or 0, scale)
    N = qkv.shape[1]
    q, k, v = qkv.split_with_sizes([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.reshape(1, N, heads, head_dim), k.reshape(1, N, kv_heads, head_dim), v.reshape(1, N, kv_heads, head_dim)
    q = q if q_norm is None else rms_norm(q, q_norm, eps, kernels)
    k = k if k_norm is None else rms_norm(k, k_norm, eps, kernels)
    q, k = apply_rope(q, cos, sin, kernels), apply_rope(k, cos, sin, kernels)
    out = ragged_attention(q, k, v, pos, token_slots, d_slots, d_kv_len, p_slots, p_index, p_pack, p_kv_len,
                           k_cache, v_cache, layer, window, scale, None, kernels)  # [1, N, H, D]
    return out.reshape(1, N, heads * head_dim)


def attend(q, pos, slots, kv_len, k_cache, v_cache, layer, window, scale, gqa, kernels=None, softcap=None):
    """q [B, T, H, D] over the first kv_len positions of cache rows `slots` -> [B, T, H, D]; `softcap`:
    the scores become softcap * tanh(scores / softcap) before the mask.

    The runtime's kernel for one-token queries (`kernels.decode_attention`) reads the cache in
    place, where the lines below copy it.
    """
    if kernels is not None and kernels.decode_attention is not None and q.shape[1] == 1:
        return kernels.decode_attention(q[:, 0], pos[:, 0], slots, k_cache, v_cache, layer, window, scale,
                                        softcap)[:, None]
    keys = k_cache[layer, :, :, :kv_len].index_select(0, slots)  # [B, KV, kv_len, D]
    values = v_cache[layer, :, :, :kv_len].index_select(0, slots)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a cache held narrower than the activations
    key_pos = torch.arange(kv_len, device=pos.device)  # [kv_len]
    mask = key_pos <= pos[..., None]  # [B, T, kv_len]: causal, and hides stale cache entries
    if window is not None:
        mask = mask & (key_pos > pos[..., None] - window)
    dtype = q.dtype
    if softcap is not None:  # SDPA has no soft cap: the scores spelled out, in float32 as the reference
        keys, values = keys.float(), values.float()
        if gqa:
            keys = keys.repeat_interleave(q.shape[2] // keys.shape[1], dim=1)
            values = values.repeat_interleave(q.shape[2] // values.shape[1], dim=1)
        scores = q.transpose(1, 2).float() @ keys.transpose(-1, -2) * scale  # [B, H, T, kv_len]
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask[:, None], float("-inf"))
        return (scores.softmax(-1) @ values).transpose(1, 2).to(dtype)
    if dtype == torch.float16 and q.device.type == "cpu":  # PyTorch's CPU float16 SDPA runs ~2.6x slower than float32's
        q, keys, values = q.float(), keys.float(), values.float()
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa,
    )  # [B, H, T, D]
    return out.transpose(1, 2).to(dtype)
'''


# The activations' dtype: the runtime's where it holds the KV cache narrower, else the cache's.
COMPUTE_DTYPE = 'dtype = g.get("compute_dtype", k_cache.dtype)'
# Kernels the runtime may hand the step (cpu/step_kernels.py's StepKernels), looked up once per step.
STEP_KERNELS = 'kernels = g.get("step_kernels")  # the runtime\'s CPU kernels for the ops between matmuls, or None'

# One template per op (placeholders: see pyemit).
TEMPLATES: dict[str, str] = {
    "positions": "{out} = {a}[:, None] + torch.arange(T, device=ids.device)",
    "rope_table": "{out} = rope_table({a}, {inv_freq}, dtype)",
    "embedding": "{out} = embedding({a}, {b})",
    "rms_norm": "{out} = rms_norm({a}, {b}, {eps}, kernels)",
    "linear": "{out} = linear({args})",
    "split": "{out} = {a}.split_with_sizes({sizes}, dim=-1)",  # no Python wrapper: Tensor.split costs ~3 us more a call
    "reshape": "{out} = {a}.reshape({shape})",
    "rope": "{out} = apply_rope({args}, kernels)",
    "attention": "{out} = attention({args}, kv_len, k_cache, v_cache, i, {window}, {scale}, {softcap}, kernels)",
    "silu": "{out} = silu({a}, kernels)",
    "gelu": "{out} = F.gelu({a}, approximate={approximate})",
    "mul": "{out} = {a} * {b}",
    "scale": "{out} = {a} * {factor}",
    "softcap": "{out} = softcap({a}, {cap})",
    "pick": "{out} = ({args})[{index}]",
    "add": "{out} = {a} + {b}",
    "route": "{out} = route({a}, {top_k}, {normalize})",
    "experts": "{out} = experts({args}, {top_k}, {act})",
    "last_token": "{out} = {a} if all_logits else {a}[torch.arange(B, device=ids.device), last].unsqueeze(1)",
    # The real last position: with all logits, a padded prompt's last token is at `last`.
    "argmax": "{out} = argmax({a}[torch.arange(B, device=ids.device), last if all_logits else 0], kernels)",
}
# The ragged form has no positions op (positions are an input) and one entry per wanted token.
RAGGED_TEMPLATES: dict[str, str] = {
    **{op: t for op, t in TEMPLATES.items() if op != "positions"},
    "attention": "{out} = ragged_attention({args}, k_cache, v_cache, i, {window}, {scale}, {softcap}, kernels)",
    "last_token": "{out} = {a}[0, {b}, None]",
    "argmax": "{out} = argmax({a}[:, 0], kernels)",
}

TORCH = Dialect(
    name="torch",
    prelude=PRELUDE,
    templates=TEMPLATES,
    array="torch.tensor",
    float32="torch.float32",
    contract=(
        "step(weights, ids, start, slots, last, kv_len, k_cache, v_cache, all_logits=False)",
        "  -> (next_token, logits)",
        "  ids [B, T] int64; start [B] first position of the step per row; slots [B] cache rows;",
        "  last [B] the position in T whose logits are wanted (T - 1 unless prompts are padded);",
        "  k_cache, v_cache [{layers}, rows, {kv_heads}, cache_len, {head_dim}]; kv_len: positions to attend over.",
        "  The caches hold the activations' dtype, or a narrower one named by weights['global']['compute_dtype'].",
    ),
    signature="def step(weights, {inputs}, last, kv_len: int, k_cache, v_cache, all_logits: bool = False):",
    setup=('g, layers = weights["global"], weights["layers"]', "B, T = ids.shape", COMPUTE_DTYPE,
           STEP_KERNELS),
    loop="for i, w in enumerate(layers):",
    returns="return {outputs}",
    frees=True,
)

TORCH_RAGGED = replace(
    TORCH,
    templates=RAGGED_TEMPLATES,
    contract=(
        "step(weights, ids, pos, token_slots, d_slots, d_kv_len, p_slots, p_index, p_pack, p_kv_len,",
        "     logits_index, k_cache, v_cache) -> (next_token [E], logits [E, 1, V])",
        "  One ragged step (see linnet_core/ir/ragged.py): ids, pos, token_slots [1, N] int64, the",
        "  one-token rows' tokens first; d_slots [Bd]; p_slots [Bp], p_index [Bp, Tp], p_pack [Np] for",
        "  the chunks; d_kv_len, p_kv_len: ints, positions each group attends over; logits_index [E].",
        "  k_cache, v_cache [{layers}, rows, {kv_heads}, cache_len, {head_dim}], updated in place.",
        "  The caches hold the activations' dtype, or a narrower one named by weights['global']['compute_dtype'].",
    ),
    signature="def step(weights, {inputs}, k_cache, v_cache):",
    groups=groups,  # the eager step's fused calls (torch_groups)
    setup=('g, layers = weights["global"], weights["layers"]', "N = ids.shape[1]", COMPUTE_DTYPE,
           STEP_KERNELS),
    ragged=True,
)


def emit(g: Graph) -> str:
    """The generated PyTorch module for graph `g`, in its step form."""
    return emit_module(g, TORCH_RAGGED if g.ragged else TORCH)
