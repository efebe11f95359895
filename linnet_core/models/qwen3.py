"""Qwen3: per-head RMS norm of q and k before rope; `head_dim` may differ from hidden / heads."""

from __future__ import annotations

from .decoder import GgufLayout, hf_llama_style_names
from .spec import ModelSpec, common_spec, positive_int, windows_from_max_window_layers

MODEL_TYPE = "qwen3"
ALIASES = ()
HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM"}
GGUF = GgufLayout("qwen3")


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    windows = windows_from_max_window_layers(cfg, positive_int(cfg, "num_hidden_layers"))
    overrides = {"layer_windows": windows} if windows is not None else {}
    return common_spec(cfg, model_type, MODEL_TYPE, qk_norm=True, **overrides)


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return hf_llama_style_names(spec, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm=True)
