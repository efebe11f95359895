"""Emitter: Linnet IR -> a readable, self-contained PyTorch module (one line per IR node).

Each op renders through one template in TEMPLATES (see pyemit for the machinery); the layer
block becomes a plain `for` loop over per-layer weight dicts.
"""

from __future__ import annotations

from ..ir.graph import Graph
from .pyemit import Dialect, emit_module

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


def attention(q, k, v, pos, slots, kv_len, k_cache, v_cache, layer, window, scale, ragged=None):
    """Write k, v at `pos` of cache rows `slots` of `layer`, then attend over the first kv_len positions.

    q [B, T, H, D]; k, v [B, T, KV, D]; caches [L, rows, KV, S, D]; returns [B, T, H, D].
    The write indexes the whole cache (no view of it), so a compiler can update it in place.
    A ragged step (B = 1, T = N tokens of many rows) attends twice: the one-token rows, then the
    chunks padded to one length (see `ragged` in step's docstring).
    """
    rows = slots[:, None].expand_as(pos) if ragged is None else ragged["token_slots"]  # [B, T]
    layers = torch.full_like(pos, layer)  # [B, T]
    k_cache[layers, rows, :, pos] = k  # advanced indices first: the target is [B, T, KV, D]
    v_cache[layers, rows, :, pos] = v
    gqa = q.shape[2] != k.shape[2]
    if ragged is None:
        return attend(q, pos, slots, kv_len, k_cache, v_cache, layer, window, scale, gqa)
    outs, n_decode = [], ragged["d_slots"].shape[0]
    if n_decode:  # [1, Bd, H, D] -> [Bd, 1, H, D] and back
        out = attend(q[0, :n_decode, None], pos[0, :n_decode, None], ragged["d_slots"], ragged["d_kv_len"],
                     k_cache, v_cache, layer, window, scale, gqa)
        outs.append(out[:, 0][None])
    if ragged["p_slots"].shape[0]:  # [1, N, H, D] -> [Bp, Tp, H, D] -> [1, Np, H, D]
        index = ragged["p_index"]
        out = attend(q[0][index], pos[0][index], ragged["p_slots"], ragged["p_kv_len"],
                     k_cache, v_cache, layer, window, scale, gqa)
        outs.append(out.flatten(0, 1)[ragged["p_pack"]][None])
    return torch.cat(outs, dim=1)


def attend(q, pos, slots, kv_len, k_cache, v_cache, layer, window, scale, gqa):
    """q [B, T, H, D] over the first kv_len positions of cache rows `slots` -> [B, T, H, D]."""
    keys = k_cache[layer, :, :, :kv_len].index_select(0, slots)  # [B, KV, kv_len, D]
    values = v_cache[layer, :, :, :kv_len].index_select(0, slots)
    key_pos = torch.arange(kv_len, device=pos.device)  # [kv_len]
    mask = key_pos <= pos[..., None]  # [B, T, kv_len]: causal, and hides stale cache entries
    if window is not None:
        mask = mask & (key_pos > pos[..., None] - window)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa,
    )  # [B, H, T, D]
    return out.transpose(1, 2)
'''


# One template per op (placeholders: see pyemit).
TEMPLATES: dict[str, str] = {
    "positions": "{out} = {a}[:, None] + torch.arange(T, device=ids.device) if ragged is None else ragged['pos']",
    "rope_table": "{out} = rope_table({a}, ROPE_INV_FREQ, dtype)",
    "embedding": "{out} = F.embedding({a}, {b})",
    "rms_norm": "{out} = rms_norm({a}, {b}, {eps})",
    "linear": "{out} = linear({args})",
    "split": "{out} = {a}.split({sizes}, dim=-1)",
    "reshape": "{out} = {a}.reshape({shape})",
    "rope": "{out} = apply_rope({args})",
    "attention": "{out} = attention({args}, kv_len, k_cache, v_cache, i, {window}, {scale}, ragged)",
    "silu": "{out} = F.silu({a})",
    "gelu": "{out} = F.gelu({a}, approximate={approximate})",
    "mul": "{out} = {a} * {b}",
    "add": "{out} = {a} + {b}",
    "last_token": "{out} = {a} if all_logits else {a}[torch.arange(B, device=ids.device), last].unsqueeze(1) "
                  "if ragged is None else {a}[0, ragged['logits_index'], None]",
    "argmax": "{out} = {a}[:, -1].argmax(dim=-1)",
}


TORCH = Dialect(
    name="torch",
    prelude=PRELUDE,
    templates=TEMPLATES,
    array="torch.tensor",
    float32="torch.float32",
    contract=(
        "step(weights, ids, start, slots, last, kv_len, k_cache, v_cache, all_logits=False, ragged=None)",
        "  -> (next_token, logits)",
        "  ids [B, T] int64; start [B] first position of the step per row; slots [B] cache rows;",
        "  last [B] the position in T whose logits are wanted (T - 1 unless prompts are padded);",
        "  k_cache, v_cache [{layers}, rows, {kv_heads}, cache_len, {head_dim}]; kv_len: positions to attend over.",
        "  ragged: a step of N tokens from many rows, ids [1, N]: a dict of pos and token_slots [1, N],",
        "  d_slots [Bd] (rows of the first Bd tokens, one each), p_slots [Bp] and p_index [Bp, Tp] (the",
        "  chunks' tokens, padded by repeating the last), p_pack [Np], d_kv_len, p_kv_len, logits_index [E];",
        "  start, last and kv_len are then unused.",
    ),
    signature="def step(weights, ids, start, slots, last, kv_len: int, k_cache, v_cache, all_logits: bool = False,\n"
              "         ragged=None):",
    setup=('g, layers = weights["global"], weights["layers"]', "B, T = ids.shape", "dtype = k_cache.dtype"),
    loop="for i, w in enumerate(layers):",
    returns="return {outputs}",
)


def emit(g: Graph) -> str:
    """The generated PyTorch module for graph `g`."""
    return emit_module(g, TORCH)
