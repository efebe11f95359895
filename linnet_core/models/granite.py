"""Granite 3: the Llama decoder with four multipliers from its config (embedding, residual branch,
attention scores, logits)."""

from __future__ import annotations

from .decoder import GgufLayout, hf_llama_style_names
from .spec import ModelSpec, common_spec, finite

MODEL_TYPE = "granite"
ALIASES = ()
HF_ARCHITECTURES = {"granite": "GraniteForCausalLM"}
GGUF = GgufLayout("granite", rope_interleaved=True, config_keys={
    "embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"})


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    def number(key: str) -> float:
        return finite(cfg.get(key, 1.0), key)

    return common_spec(cfg, model_type, MODEL_TYPE, embedding_scale=number("embedding_multiplier"),
                       residual_scale=number("residual_multiplier"), attention_scale=number("attention_multiplier"),
                       logit_scale=1.0 / number("logits_scaling"))  # the config divides the logits by it


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return hf_llama_style_names(spec, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, mlp_bias=spec.mlp_bias)
