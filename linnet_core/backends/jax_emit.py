"""Emitter: Linnet IR -> a readable JAX module ("generated JAX"), a pure function for `jax.jit`.

`step` takes the weights, the whole KV cache and the step's tokens and returns the next tokens,
the logits and the updated cache; the runtime jits it with static shapes (prompts padded to
buckets, `last` says which position is real) and donates the cache, so XLA updates it in place.
"""

from __future__ import annotations

from ..ir.graph import Graph
from .pyemit import Dialect, emit_module

PRELUDE = '''
import jax
import jax.numpy as jnp


def rope_table(pos, inv_freq, dtype):
    """cos, sin [B, T, rot] for positions [B, T]; computed in float32 like transformers."""
    freqs = pos[..., None].astype(jnp.float32) * inv_freq  # [B, T, rot/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, rot]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def dequantize(weight):
    """A weight as float32: GGUF blocks come as (values uint8 [..., nb, 32 * bits / 8], scales
    [..., nb]), 4-bit values two to a byte (low nibble first), offset by 2^(bits - 1)."""
    if not isinstance(weight, tuple):
        return weight
    values, scales = weight
    bits = values.shape[-1] * 8 // 32
    if bits == 4:
        values = jnp.stack([values & 0x0F, values >> 4], axis=-1).reshape(*values.shape[:-1], 32)
    w = (values.astype(jnp.float32) - (1 << (bits - 1))) * scales[..., None]  # [..., nb, 32]
    return w.reshape(*w.shape[:-2], -1)


def precision(x):
    """HIGHEST for float32 dots: XLA's GPU default runs them in TF32 (a 10-bit mantissa), ~1e-2 off."""
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def linear(x, weight, bias=None):
    """x @ weight.T (+ bias); XLA reads the [out, in] weight as it lies (block-quantized weights
    dequantized in the graph, where XLA can fuse it into the dot)."""
    y = jnp.einsum("...i,oi->...o", x, dequantize(weight), precision=precision(x))
    return y if bias is None else y + bias


def embedding(ids, table):
    """The rows of `table` for ids [B, T]; only the rows looked up are dequantized."""
    if isinstance(table, tuple):
        return dequantize((table[0][ids], table[1][ids]))
    return table[ids]


def split(x, sizes):
    """Split the last axis into parts of the given sizes."""
    return jnp.split(x, [sum(sizes[:k]) for k in range(1, len(sizes))], axis=-1)


def rms_norm(x, weight, eps):
    """x / rms(x) * weight over the last axis; the statistics in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def scale_by(x, factor):
    """x * a config constant, the product in float32 (as PyTorch multiplies a 16-bit tensor by a float)."""
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


def apply_rope(x, cos, sin):
    """Rotate-half rope on the first rot features of each head; x [B, T, heads, D]."""
    rot = cos.shape[-1]
    cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, rot]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else jnp.concatenate([out, x_pass], axis=-1)


def softcap(x, cap):
    """cap * tanh(x / cap), in float32: values held below cap (Gemma 2's logits)."""
    return (cap * jnp.tanh(x.astype(jnp.float32) / cap)).astype(x.dtype)


def route(logits, top_k, normalize):
    """Each expert's weight [..., E]: the softmax of the router's logits in float32, its top_k kept
    (renormalized to sum to 1 where the model does), the rest 0."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, index = jax.lax.top_k(probs, top_k)  # the lower expert first on ties
    if normalize:
        top = top / top.sum(-1, keepdims=True)
    kept = (jax.nn.one_hot(index, probs.shape[-1], dtype=jnp.float32) * top[..., None]).sum(-2)
    return kept.astype(logits.dtype)


def experts(x, weights, gate, up, down, top_k, act):
    """x [..., H] through the experts weights [..., E] chose, dense: every expert over every token,
    weight 0 where not chosen (static shapes XLA compiles whole, at E / top_k times the chosen
    experts' multiplications)."""
    count, hidden = weights.shape[-1], x.shape[-1]
    gate_x = linear(x, gate)
    if act == "silu":
        gated = jax.nn.silu(gate_x)
    else:
        gated = jax.nn.gelu(gate_x, approximate=act == "gelu_tanh")
    h = (gated * linear(x, up)).reshape(*x.shape[:-1], count, -1) * weights[..., None]  # [..., E, F]
    stacked = dequantize(down).astype(x.dtype).reshape(count, hidden, -1)  # [E, H, F]
    return jnp.einsum("...ef,ehf->...h", h, stacked, precision=precision(x))


def attention(q, k, v, pos, slots, k_cache, v_cache, layer, window, scale, softcap):
    """Write k, v at `pos` of rows `slots` of layer `layer`, then attend causally over the cache.

    q [B, T, H, D]; k, v [B, T, KV, D]; caches [L, rows, KV, S, D] (returned updated);
    positions past the cache and rows past `rows` (padding) are dropped, never written.
    """
    rows = jnp.broadcast_to(slots[:, None], pos.shape)  # [B, T]
    k_cache = k_cache.at[layer, rows, :, pos].set(k, mode="drop")  # the target is [B, T, KV, D]
    v_cache = v_cache.at[layer, rows, :, pos].set(v, mode="drop")
    keys = k_cache[layer].at[slots].get(mode="clip")  # [B, KV, S, D]
    values = v_cache[layer].at[slots].get(mode="clip")
    B, T, H, D = q.shape
    KV = k.shape[2]
    key_pos = jnp.arange(keys.shape[2])  # [S]
    mask = key_pos <= pos[..., None]  # [B, T, S]: causal, and hides stale cache entries
    if window is not None:
        mask = mask & (key_pos > pos[..., None] - window)
    qg = q.reshape(B, T, KV, H // KV, D)  # query heads grouped by their KV head
    # scores come out of the dot in float32, unrounded, as SDPA's and the reference's do
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, keys, precision=precision(q),
                        preferred_element_type=jnp.float32) * scale  # [B, KV, G, T, S]
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # in float32, as the reference does
    out = jnp.einsum("bkgts,bksd->btkgd", probs, values, precision=precision(q))  # [B, T, KV, G, D]
    return out.reshape(B, T, H, D), k_cache, v_cache
'''

TEMPLATES: dict[str, str] = {
    "positions": "{out} = {a}[:, None] + jnp.arange(T)",
    "rope_table": "{out} = rope_table({a}, {inv_freq}, dtype)",
    "embedding": "{out} = embedding({a}, {b})",
    "rms_norm": "{out} = rms_norm({a}, {b}, {eps})",
    "linear": "{out} = linear({args})",
    "split": "{out} = split({a}, {sizes})",
    "reshape": "{out} = {a}.reshape({shape})",
    "rope": "{out} = apply_rope({args})",
    "attention": "{out}, k_cache, v_cache = attention({args}, k_cache, v_cache, i, {window}, {scale}, {softcap})",
    "silu": "{out} = jax.nn.silu({a})",
    "gelu": "{out} = jax.nn.gelu({a}, approximate=({approximate} == 'tanh'))",
    "mul": "{out} = {a} * {b}",
    "scale": "{out} = scale_by({a}, {factor})",
    "softcap": "{out} = softcap({a}, {cap})",
    "pick": "{out} = ({args})[{index}]",
    "add": "{out} = {a} + {b}",
    "route": "{out} = route({a}, {top_k}, {normalize})",
    "experts": "{out} = experts({args}, {top_k}, {act})",
    "last_token": "{out} = {a} if all_logits else jnp.take_along_axis({a}, last[:, None, None], axis=1)",
    "argmax": "{out} = jnp.argmax({a}[jnp.arange(B), last if all_logits else 0], axis=-1)",
}

JAX = Dialect(
    name="JAX",
    prelude=PRELUDE,
    templates=TEMPLATES,
    array="jnp.array",
    float32="jnp.float32",
    contract=(
        "step(weights, k_cache, v_cache, ids, start, slots, last, all_logits=False)",
        "    -> (next_token, logits, k_cache, v_cache)",
        "  ids [B, T] int32; start [B] first position of the step per row; slots [B] cache rows;",
        "  last [B] the position in T whose logits are wanted (prompts are padded to buckets);",
        "  k_cache, v_cache [{layers}, rows, {kv_heads}, cache_len, {head_dim}], returned updated.",
        "A pure function: jit it with all_logits static and the caches donated.",
    ),
    signature="def step(weights, k_cache, v_cache, ids, start, slots, last, all_logits: bool = False):",
    setup=('g, layers = weights["global"], weights["layers"]', "B, T = ids.shape", "dtype = k_cache.dtype"),
    loop="for i, w in enumerate(layers):",
    returns="return {outputs}, k_cache, v_cache",
)


def emit(g: Graph) -> str:
    """The generated JAX module for graph `g`."""
    return emit_module(g, JAX)
