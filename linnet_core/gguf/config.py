"""A GGUF file's metadata as the config.json its family parses, and its tensors' Hugging Face names.

llama.cpp keys a model's settings by architecture (`{arch}.embedding_length`, ...). Each family's
GgufLayout names its architecture, so `general.architecture` picks the family and the keys become
the config fields that family's `parse_config` reads: one ModelSpec whichever file a model came
from. Tensor names go the other way from the export (decoder roles, the layout's renames), and
the layout says which rows llama.cpp permuted.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import UnsupportedModel
from ..models import FAMILIES
from ..models.spec import ModelSpec

ARCHITECTURES = {fam.GGUF.arch: fam for fam in FAMILIES.values()}
# llama.cpp's rope scaling types Linnet computes (its llama3 scaling comes as a rope_freqs tensor).
ROPE_SCALING = ("none", "linear")


def _one(value: Any, key: str) -> Any:
    """A per-layer array llama.cpp allows for some keys, accepted when every layer agrees."""
    if isinstance(value, np.ndarray | list):
        values = {int(v) for v in value}
        if len(values) != 1:
            raise UnsupportedModel(f"GGUF key '{key}' differs between layers ({sorted(values)[:4]}...), "
                                   "which Linnet's decoder does not model")
        return values.pop()
    return value


def config_from_gguf(meta: dict[str, Any], tensors: set[str], values: Callable[[str], np.ndarray]) -> dict[str, Any]:
    """The Hugging Face config a GGUF's metadata describes (`values(name)` reads a tensor the config
    needs: rope_freqs); refused by name where Linnet lacks it."""
    arch = meta.get("general.architecture")
    fam = ARCHITECTURES.get(arch)
    if fam is None:
        raise UnsupportedModel(f"GGUF architecture '{arch}' is not supported (supported: {', '.join(ARCHITECTURES)})")

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return _one(meta[full], full)
        if required and default is None:
            raise UnsupportedModel(f"the GGUF has no '{full}', which a {arch} model needs")
        return default

    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise UnsupportedModel("the GGUF scales its rope by rope_factors tensors (LongRoPE, Phi-3 128k), "
                               "which Linnet does not model", hint="use a 4k-context model")
    scaling = key("rope.scaling.type", "none", required=False)
    if scaling not in ROPE_SCALING:
        raise UnsupportedModel(f"GGUF rope scaling '{scaling}' is not supported (supported: {', '.join(ROPE_SCALING)})")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModel("the GGUF's value heads differ in size from its key heads, which Linnet does not model")
    rotary = int(key("rope.dimension_count", head_dim))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size", len(tokens) if tokens is not None else None)
    cfg: dict[str, Any] = {
        "model_type": fam.MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "partial_rotary_factor": rotary / head_dim,
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        "mlp_bias": "blk.0.ffn_down.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": float(key("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensors:  # llama3-style scaling, as per-frequency divisors
        if scaling != "none":
            raise UnsupportedModel(f"the GGUF scales its rope twice (a rope_freqs tensor and '{scaling}' scaling)")
        factors = np.asarray(values("rope_freqs.weight"), dtype=np.float64).reshape(-1)
        if factors.size != rotary // 2 or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise UnsupportedModel(f"the GGUF's rope_freqs holds {factors.size} values where its rotary dimension "
                                   f"{rotary} needs {rotary // 2} positive ones")
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    window = key("attention.sliding_window", 0, required=False)
    if window:
        cfg["sliding_window"] = int(window)
        cfg["use_sliding_window"] = True
        cfg["max_window_layers"] = 0  # a window a GGUF declares covers every layer
    return cfg


def gguf_tensor_names(spec: ModelSpec) -> dict[str, tuple[str, int | None]]:
    """Each Hugging Face tensor name the family's weight map uses -> (its GGUF name, the heads whose
    rows llama.cpp permuted to adjacent-pair rope, or None)."""
    fam = FAMILIES[spec.family]
    layout = fam.GGUF
    out: dict[str, tuple[str, int | None]] = {}
    for role, hf in fam.weight_names(spec).items():
        base, _, suffix = role.rpartition(".")
        heads = spec.num_heads if base == "attn_q" else spec.num_kv_heads if base == "attn_k" else None
        heads = heads if layout.rope_interleaved else None
        if "{i}" not in hf:
            out[hf] = (role, None)
            continue
        for i in range(spec.num_layers):
            out[hf.format(i=i)] = (f"blk.{i}.{layout.renames.get(base, base)}.{suffix}", heads)
    return out
