"""A small numpy reference for each IR op: what the op means, in float64 where it matters.

Each function takes the op's inputs as numpy arrays and its attributes by name; ops whose result
depends on the step's frame take that too (`all_logits`, `last`; attention the KV cache and the
layer). They are written for clarity, one token at a time where that is clearest, and checked
against every emitter by tests/test_conformance.py, so a wrong lowering is named by op and emitter.
"""

from __future__ import annotations

import math

import numpy as np

from .rope import inv_freq


def positions(start, ids):
    return start[:, None] + np.arange(ids.shape[1])  # [B, T]


def rope_table(pos, *, rope, rotary_dim):
    freqs = np.asarray(inv_freq(rope, rotary_dim), dtype=np.float32)
    angles = pos[..., None].astype(np.float32) * freqs  # [B, T, rot/2], float32 as transformers
    emb = np.concatenate([angles, angles], axis=-1)
    return np.cos(emb), np.sin(emb)


def embedding(ids, table):
    return table[ids]


def rms_norm(x, weight, *, eps):
    x64 = x.astype(np.float64)
    return weight * (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps))


def linear(x, weight, bias=None):
    y = x.astype(np.float64) @ weight.T.astype(np.float64)
    return y if bias is None else y + bias


def split(x, *, sizes):
    return np.split(x, np.cumsum(sizes)[:-1], axis=-1)


def reshape(x, *, shape):
    # a symbol keeps the size of the input's axis at the same place (B and T)
    return x.reshape([x.shape[i] if isinstance(d, str) else d for i, d in enumerate(shape)])


def rope(x, cos, sin, *, apply=True):
    if not apply:
        return x
    rot = cos.shape[-1]
    half = rot // 2
    c, s = cos[:, :, None], sin[:, :, None]
    x_rot = x[..., :rot]
    rotated = np.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return np.concatenate([x_rot * c + rotated * s, x[..., rot:]], axis=-1)


def attention(q, k, v, pos, slots, *index, scale, window, softcap, ragged, k_cache, v_cache, layer):
    """Returns (out like q, k_cache, v_cache): every token's k, v written at its row and position
    first, then each token attends to the positions <= its own (within the window) of its row."""
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    rows = slots if ragged else np.broadcast_to(slots[:, None], pos.shape)  # [B, T] either way
    B, T, H, D = q.shape
    group = H // k.shape[2]
    for b in range(B):
        for t in range(T):
            k_cache[layer, rows[b, t], :, pos[b, t]] = k[b, t]
            v_cache[layer, rows[b, t], :, pos[b, t]] = v[b, t]
    out = np.zeros(q.shape, dtype=np.float64)
    for b in range(B):
        for t in range(T):
            p = pos[b, t]
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(H):
                keys = k_cache[layer, rows[b, t], h // group, lo:p + 1].astype(np.float64)  # [n, D]
                values = v_cache[layer, rows[b, t], h // group, lo:p + 1].astype(np.float64)
                scores = keys @ q[b, t, h].astype(np.float64) * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                probs = np.exp(scores - scores.max())
                out[b, t, h] = probs / probs.sum() @ values
    return out, k_cache, v_cache


def silu(x):
    return x / (1 + np.exp(-x.astype(np.float64)))


def gelu(x, *, approximate):
    x = x.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def mul(a, b):
    return a * b


def scale(x, *, factor):
    return x.astype(np.float64) * factor


def softcap(x, *, cap):
    return cap * np.tanh(x.astype(np.float64) / cap)


def pick(*xs, index):
    return xs[index]


def add(a, b):
    return a + b


def route(logits, *, top_k, normalize):
    x = logits.astype(np.float32)
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]  # the lower expert first on ties
    kept = np.zeros_like(probs)
    np.put_along_axis(kept, order, np.take_along_axis(probs, order, -1), -1)
    return kept / kept.sum(-1, keepdims=True) if normalize else kept


def experts(x, weights, gate, up, down, *, top_k, act):
    """Token by token, each expert with a nonzero weight applied and summed (an expert no token
    chose is never touched)."""
    count, hidden = weights.shape[-1], x.shape[-1]
    width = gate.shape[0] // count
    activation = {"silu": silu, "gelu": lambda v: gelu(v, approximate="none"),
                  "gelu_tanh": lambda v: gelu(v, approximate="tanh")}[act]
    flat, w = x.reshape(-1, hidden).astype(np.float64), weights.reshape(-1, count)
    out = np.zeros(flat.shape, dtype=np.float64)
    for t in range(flat.shape[0]):
        for e in np.flatnonzero(w[t]):
            rows = slice(e * width, (e + 1) * width)
            h = activation(gate[rows] @ flat[t]) * (up[rows] @ flat[t])
            out[t] += w[t, e] * (down[e * hidden:(e + 1) * hidden] @ h)
    return out.reshape(x.shape)


def last_token(x, logits_index=None, *, ragged, all_logits=False, last=None):
    if ragged:
        return x[0, logits_index, None]  # [E, 1, ...]
    return x if all_logits else x[np.arange(x.shape[0]), last][:, None]


def argmax(logits, *, all_logits=False, last=None):
    at = last if all_logits else np.zeros(logits.shape[0], dtype=np.int64)
    return logits[np.arange(logits.shape[0]), at].argmax(-1)


REFERENCES = {
    "positions": positions, "rope_table": rope_table, "embedding": embedding, "rms_norm": rms_norm,
    "linear": linear, "split": split, "reshape": reshape, "rope": rope, "attention": attention,
    "silu": silu, "gelu": gelu, "mul": mul, "scale": scale, "softcap": softcap, "pick": pick, "add": add,
    "route": route, "experts": experts,
    "last_token": last_token, "argmax": argmax,
}
