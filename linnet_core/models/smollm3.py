"""SmolLM3: the Llama decoder with rope left out of some layers (NoPE), by `no_rope_layers`."""

from __future__ import annotations

from ..errors import CheckpointError
from .decoder import GgufLayout, hf_llama_style_names
from .spec import ModelSpec, common_spec, positive_int

MODEL_TYPE = "smollm3"
ALIASES = ()
HF_ARCHITECTURES = {"smollm3": "SmolLM3ForCausalLM"}
GGUF = GgufLayout("smollm3", rope_interleaved=True, no_rope_every=4)  # llama.cpp: every 4th layer


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    layers = positive_int(cfg, "num_hidden_layers")
    flags = cfg.get("no_rope_layers")  # per layer: 1 rotates, 0 does not
    if flags is None:
        every = positive_int(cfg, "no_rope_layer_interval", default=4)
        flags = [int((i + 1) % every != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise CheckpointError(f"config.json: 'no_rope_layers' must list 0 or 1 for each of the {layers} layers",
                              hint="the config is damaged or not a model's config")
    return common_spec(cfg, model_type, MODEL_TYPE, no_rope_layers=tuple(i for i, f in enumerate(flags) if not f))


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return hf_llama_style_names(spec, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, mlp_bias=spec.mlp_bias)
