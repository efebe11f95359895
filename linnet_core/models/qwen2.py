"""Qwen2 / Qwen2.5: the Llama layout with biases on q, k, v (never on o), windows from `layer_types`."""

from __future__ import annotations

from .decoder import GgufLayout, hf_llama_style_names
from .spec import ModelSpec, common_spec, positive_int, windows_from_max_window_layers

MODEL_TYPE = "qwen2"
ALIASES = ()
HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM"}
GGUF = GgufLayout("qwen2")


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    windows = windows_from_max_window_layers(cfg, positive_int(cfg, "num_hidden_layers"))
    overrides = {"layer_windows": windows} if windows is not None else {}
    return common_spec(cfg, model_type, MODEL_TYPE, qkv_bias=True, o_bias=False, **overrides)


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return hf_llama_style_names(spec, qkv_bias=True)
