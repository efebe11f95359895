"""A GGUF file's metadata as the config.json its family parses, and its tensors' Hugging Face names.

llama.cpp keys a model's settings by architecture (`{arch}.embedding_length`, ...). Each family's
GgufLayout names its architecture, so `general.architecture` picks the family and the keys become
the config fields that family's `parse_config` reads: one ModelSpec whichever file a model came
from. Tensor names go the other way from the export (decoder roles, the layout's renames), and
the layout says which rows llama.cpp permuted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CheckpointError, UnsupportedModel
from ..models import FAMILIES, weight_names
from ..models.spec import ModelSpec
from .reader import GGUFFile
from .schema import MAX_CONTEXT, Metadata

ARCHITECTURES = {fam.GGUF.arch: fam for fam in FAMILIES.values()}
# llama.cpp's rope scaling types Linnet computes (its llama3 scaling comes as a rope_freqs tensor).
ROPE_SCALING = ("none", "linear")


def config_from_gguf(g: GGUFFile) -> dict[str, Any]:
    """The Hugging Face config a GGUF's metadata describes, every key checked (gguf.schema) and held
    against the tensors present; refused by name where Linnet lacks it.

    Where llama.cpp refuses a file, Linnet does too: a block count other than the blocks the tensors
    hold, a token list of another length than the token table's rows."""
    md = Metadata(g)
    arch = md.string("general.architecture", None)
    fam = ARCHITECTURES.get(arch)
    if fam is None:
        raise UnsupportedModel(f"GGUF architecture '{str(arch)[:40]}' is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    if "rope_factors_long.weight" in g.tensors or "rope_factors_short.weight" in g.tensors:
        raise UnsupportedModel("the GGUF scales its rope by rope_factors tensors (LongRoPE, Phi-3 128k), "
                               "which Linnet does not model", hint="use a 4k-context model")
    scaling = md.string(key("rope.scaling.type"), "none")
    if scaling not in ROPE_SCALING:
        raise UnsupportedModel(f"GGUF rope scaling '{scaling[:40]}' is not supported "
                               f"(supported: {', '.join(ROPE_SCALING)})")
    hidden = md.count(key("embedding_length"))
    vocab = _vocab_size(md, key, hidden)
    heads = md.count(key("attention.head_count"), per_layer=True)
    kv_heads = md.count(key("attention.head_count_kv"), heads, per_layer=True, most=heads)
    if heads % kv_heads:
        raise md.fail(key("attention.head_count_kv"), f"holds {kv_heads}, which does not divide the {heads} heads")
    if key("attention.key_length") not in md.values and hidden % heads:
        raise md.fail(key("attention.head_count"), f"holds {heads}, which does not divide the embedding width "
                                                   f"{hidden}, and no attention.key_length gives the head width")
    head_dim = md.count(key("attention.key_length"), hidden // heads)
    if md.count(key("attention.value_length"), head_dim) != head_dim:
        raise UnsupportedModel("the GGUF's value heads differ in size from its key heads, which Linnet does not model")
    rotary = md.count(key("rope.dimension_count"), head_dim, least=2, most=head_dim)
    if rotary % 2:
        raise md.fail(key("rope.dimension_count"), f"holds {rotary}, which is odd (rope turns pairs of features)")
    layers = md.count(key("block_count"))
    if layers != md.layers_present():
        raise md.fail(key("block_count"), f"holds {layers}, but the file's tensors are for {md.layers_present()} blocks")
    ffn = md.count(key("feed_forward_length"), per_layer=True)
    _check_shapes(md, key, heads, kv_heads, head_dim, hidden, ffn)
    voc = md.vocabulary()
    if voc is not None and len(voc.tokens) != vocab:
        raise md.fail("tokenizer.ggml.tokens", f"holds {len(voc.tokens)} tokens for the {vocab} rows of "
                                              "token_embd.weight")
    cfg: dict[str, Any] = {
        "model_type": fam.MODEL_TYPE,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,  # llama.cpp scales scores by 1/sqrt(head_dim) where no key says else
        "rms_norm_eps": md.number(key("attention.layer_norm_rms_epsilon"), below=1.0),
        "rope_theta": md.number(key("rope.freq_base"), 10000.0, above=1.0),
        "partial_rotary_factor": rotary / head_dim,
        "max_position_embeddings": md.count(key("context_length"), most=MAX_CONTEXT),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors or "blk.0.attn_qkv.bias" in g.tensors,
        "mlp_bias": "blk.0.ffn_down.bias" in g.tensors,
        "bos_token_id": voc.bos if voc else None,
        "pad_token_id": voc.padding if voc else None,  # not the config class's default, which may lie past the table
        "eos_token_id": voc.eos if voc else None,
    }
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": md.number(key("rope.scaling.factor"))}
    if "rope_freqs.weight" in g.tensors:  # llama3-style scaling, as per-frequency divisors
        if scaling != "none":
            raise UnsupportedModel(f"the GGUF scales its rope twice (a rope_freqs tensor and '{scaling}' scaling)")
        factors = np.asarray(g.tensor("rope_freqs.weight"), dtype=np.float64).reshape(-1)
        if factors.size != rotary // 2 or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise UnsupportedModel(f"the GGUF's rope_freqs holds {factors.size} values where its rotary dimension "
                                   f"{rotary} needs {rotary // 2} positive ones")
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    experts = md.count(key("expert_count"), 0, least=0, most=1 << 12)
    if experts:  # a mixture of experts: llama.cpp's files renormalize the chosen experts' weights
        cfg["model_type"] = fam.GGUF.moe_model_type or fam.MODEL_TYPE
        cfg["num_experts"] = experts
        cfg["num_experts_per_tok"] = md.count(key("expert_used_count"), most=experts)
        cfg["moe_intermediate_size"] = md.count(key("expert_feed_forward_length"), ffn)
        cfg["norm_topk_prob"] = True
    for name, config_key in fam.GGUF.config_keys.items():
        if key(name) in md.values:
            cfg[config_key] = md.number(key(name))
    if fam.GGUF.no_rope_every:  # llama.cpp's fixed NoPE layers, as the config's per-layer flags
        cfg["no_rope_layers"] = [int(i not in fam.GGUF.no_rope_layers(layers)) for i in range(layers)]
    if fam.GGUF.sliding_rope_theta is not None:
        cfg["rope_local_base_freq"] = md.number(key("rope.freq_base_swa"), fam.GGUF.sliding_rope_theta, above=1.0)
    window = md.count(key("attention.sliding_window"), 0, least=0, most=MAX_CONTEXT)
    if window and fam.GGUF.sliding_every:  # llama.cpp's fixed pattern of sliding and full layers
        cfg["sliding_window"] = window
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in fam.GGUF.sliding_layers(layers)]
    elif window:
        cfg["sliding_window"] = window
        cfg["use_sliding_window"] = True
        cfg["max_window_layers"] = 0  # a window a GGUF declares covers every layer
    return cfg


def _vocab_size(md: Metadata, key, hidden: int) -> int:
    """The rows of the token table, which `{arch}.vocab_size` (where given) must agree with."""
    table = md.rows("token_embd.weight")
    if table is None:
        raise CheckpointError(f"{md.path}: the GGUF has no 2-d tensor 'token_embd.weight' (the token table)")
    if table[1] != hidden:
        raise md.fail(key("embedding_length"), f"holds {hidden}, but token_embd.weight's rows are {table[1]} wide")
    declared = md.count(key("vocab_size"), table[0])
    if declared != table[0]:
        raise md.fail(key("vocab_size"), f"holds {declared}, but token_embd.weight has {table[0]} rows")
    return table[0]


def _check_shapes(md: Metadata, key, heads: int, kv_heads: int, head_dim: int, hidden: int, ffn: int) -> None:
    """The first block's projections against the widths the keys give (every tensor's shape is checked
    again as it loads)."""
    want = {"blk.0.attn_q.weight": (heads * head_dim, hidden), "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
            "blk.0.attn_qkv.weight": ((heads + 2 * kv_heads) * head_dim, hidden)}
    for name, shape in want.items():
        have = md.rows(name)
        if have is not None and have != shape:
            raise md.fail(key("attention.head_count"), f"and its neighbours give {heads} heads and {kv_heads} key/value "
                                                       f"heads of {head_dim}, which do not match {name}'s "
                                                       f"{have[0]} x {have[1]}")
    down = md.rows("blk.0.ffn_down.weight")
    if down and down[1] != ffn:
        raise md.fail(key("feed_forward_length"), f"holds {ffn}, but blk.0.ffn_down.weight's rows are {down[1]} wide")


def gguf_tensor_names(spec: ModelSpec) -> dict[str, tuple[str, int | None, int | None]]:
    """Each Hugging Face tensor name the family's weight map uses -> (its GGUF name, the heads whose
    rows llama.cpp permuted to adjacent-pair rope or None, the expert it is of a 3-d stack or None)."""
    fam = FAMILIES[spec.family]
    layout = fam.GGUF
    out: dict[str, tuple[str, int | None, int | None]] = {}
    for role, hf in weight_names(spec).items():
        base, _, suffix = role.rpartition(".")
        heads = spec.num_heads if base == "attn_q" else spec.num_kv_heads if base == "attn_k" else None
        heads = heads if layout.rope_interleaved else None
        if "{i}" not in hf:
            out[hf] = (role, None, None)
            continue
        for i in range(spec.num_layers):
            name = f"blk.{i}.{layout.renames.get(base, base)}.{suffix}"
            if "{e}" in hf:  # llama.cpp stacks a layer's experts in one tensor [E, rows, cols]
                out.update({hf.format(i=i, e=e): (name, heads, e) for e in range(spec.num_experts)})
            else:
                out[hf.format(i=i)] = (name, heads, None)
    return out
