"""Qwen2 / Qwen2.5: the Llama layout with biases on q, k, v (never on o), windows from `layer_types`."""

from __future__ import annotations

from .decoder import GgufLayout, build_decoder, hf_llama_style_names
from .spec import ModelSpec, common_spec

MODEL_TYPE = "qwen2"
ALIASES = ()
HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM"}
GGUF = GgufLayout("qwen2")


def _windows(cfg: dict, layers: int) -> tuple[int | None, ...]:
    # Older configs without `layer_types`: sliding only when enabled, from `max_window_layers` on.
    if cfg.get("layer_types") or not cfg.get("use_sliding_window"):
        return () if cfg.get("layer_types") else (None,) * layers
    first = int(cfg.get("max_window_layers", layers))
    return tuple(int(cfg["sliding_window"]) if i >= first else None for i in range(layers))


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    windows = _windows(cfg, int(cfg["num_hidden_layers"]))
    overrides = {"layer_windows": windows} if windows else {}
    return common_spec(cfg, model_type, MODEL_TYPE, qkv_bias=True, o_bias=False, **overrides)


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return hf_llama_style_names(spec, qkv_bias=True)


def build_graph(spec: ModelSpec):
    return build_decoder(spec, weight_names(spec))
