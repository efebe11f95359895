"""Gemma 3 (text): Gemma 2's decoder with per-head q/k norms instead of soft-capping, five sliding
layers to each full one, and a rope of its own for the sliding layers."""

from __future__ import annotations

from .decoder import GgufLayout
from .gemma2 import gemma_names, gemma_spec
from .spec import ModelSpec, RopeSpec, finite, read_rope

MODEL_TYPE = "gemma3_text"
ALIASES = ()
HF_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}
GGUF = GgufLayout("gemma3", sliding_every=6, sliding_rope_theta=10000.0)


def read_ropes(cfg: dict) -> tuple[RopeSpec, RopeSpec]:
    """(full layers' rope, sliding layers' rope): transformers 5 keys `rope_parameters` by layer type;
    older configs give the full layers' rope and `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        def one(kind: str) -> RopeSpec:
            return read_rope({**cfg, "rope_scaling": None, "rope_parameters": params[kind]})

        return one("full_attention"), one("sliding_attention")
    local = finite(cfg.get("rope_local_base_freq", 10000.0), "rope_local_base_freq", above=1.0)
    return read_rope(cfg), RopeSpec(theta=local)


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    full, sliding = read_ropes(cfg)
    return gemma_spec({**cfg, "rope_parameters": None, "rope_scaling": None}, model_type, MODEL_TYPE,
                      sliding_every=6, qk_norm=True, rope=full, sliding_rope=sliding)


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return gemma_names(spec, qk_norm=True)
