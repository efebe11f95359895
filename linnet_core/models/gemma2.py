"""Gemma 2: the token table scaled by √hidden, norms that scale by 1 + weight before and after each
branch, GeGLU (gelu-tanh), the query scale from `query_pre_attn_scalar`, soft-capped attention scores
and logits, and sliding-window layers alternating with full ones."""

from __future__ import annotations

import math

from .decoder import GgufLayout, hf_llama_style_names
from .spec import ModelSpec, common_spec, finite, positive_int

MODEL_TYPE = "gemma2"
ALIASES = ()
HF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM"}
GGUF = GgufLayout("gemma2", sliding_every=2, config_keys={
    "attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping"})


def gemma_spec(cfg: dict, model_type: str, family: str, sliding_every: int, **overrides) -> ModelSpec:
    """What Gemma 2 and 3 read alike; `sliding_every`: the layer pattern a config without `layer_types`
    means (every n-th layer full, the rest sliding)."""
    layers = positive_int(cfg, "num_hidden_layers")
    if not cfg.get("layer_types") and cfg.get("sliding_window"):
        every = positive_int(cfg, "sliding_window_pattern", default=sliding_every)
        cfg = {**cfg, "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention"
                                      for i in range(layers)]}

    def optional(key: str) -> float | None:
        return finite(cfg[key], key) if cfg.get(key) is not None else None

    scalar = optional("query_pre_attn_scalar")
    return common_spec(
        cfg, model_type, family,
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        embedding_scale=math.sqrt(positive_int(cfg, "hidden_size")), norm_weight_offset=1.0,
        attention_scale=scalar ** -0.5 if scalar is not None else None,
        attention_softcap=optional("attn_logit_softcapping"), logit_softcap=optional("final_logit_softcapping"),
        **overrides)


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    return gemma_spec(cfg, model_type, MODEL_TYPE, sliding_every=2)


def gemma_names(spec: ModelSpec, qk_norm: bool) -> dict[str, str]:
    """Gemma's layout: Llama's names, with a norm before and after each branch."""
    layer = "model.layers.{i}"
    names = hf_llama_style_names(spec, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm=qk_norm)
    names["post_attention_norm.weight"] = f"{layer}.post_attention_layernorm.weight"
    names["ffn_norm.weight"] = f"{layer}.pre_feedforward_layernorm.weight"
    names["post_ffw_norm.weight"] = f"{layer}.post_feedforward_layernorm.weight"
    return names


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return gemma_names(spec, qk_norm=False)
