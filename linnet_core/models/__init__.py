"""Architecture families, one module each, named after Hugging Face `model_type`.

Adding a family is one module that defines FAMILY_CONTRACT's names, and one line in FAMILIES;
variants are aliases, never copied files (docs/adding-a-family.md is the walk-through). A family
whose graph is not the shared pre-norm decoder also defines `build_graph(spec)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from ..errors import CheckpointError, UnsupportedModel
from . import gemma2, gemma3, granite, llama, olmo2, phi3, qwen2, qwen3, qwen3_moe, smollm3
from .decoder import GgufLayout, build_decoder
from .spec import ModelSpec

# What every family module defines: its config's model_type and aliases, the transformers class
# names exports declare, llama.cpp's layout, `parse_config(cfg, model_type) -> ModelSpec`, and
# `weight_names(spec)`: Linnet's tensor roles (decoder.GLOBAL_ROLES, BLOCK_ROLES) to checkpoint names.
FAMILY_CONTRACT = ("MODEL_TYPE", "ALIASES", "HF_ARCHITECTURES", "GGUF", "parse_config", "weight_names")
OPTIONAL_CONTRACT = ("build_graph",)

FAMILIES: dict[str, ModuleType] = {
    m.MODEL_TYPE: m for m in (llama, qwen2, qwen3, qwen3_moe, phi3, granite, olmo2, smollm3, gemma2, gemma3)}
MODEL_TYPES: dict[str, ModuleType] = {
    **FAMILIES, **{alias: m for m in FAMILIES.values() for alias in m.ALIASES}
}


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no config.json (is this a Hugging Face checkpoint folder?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not valid JSON") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    # Multimodal wrappers keep the decoder's settings under text_config, and its tensors under their
    # `language_model.` (transformers' own layout for them, as saved and as published).
    if isinstance(cfg.get("text_config"), dict):
        return {**cfg, **cfg["text_config"], "weight_prefix": "language_model."}
    return cfg


def family(model_type: str) -> ModuleType:
    try:
        return MODEL_TYPES[model_type]
    except KeyError:
        raise UnsupportedModel(
            f"model_type '{model_type}' is not supported (supported: {', '.join(sorted(MODEL_TYPES))})"
        ) from None


def spec_from_config(cfg: dict) -> ModelSpec:
    model_type = cfg.get("model_type")
    if not model_type:
        raise UnsupportedModel("config.json has no model_type")
    try:
        return family(model_type).parse_config(cfg, model_type)
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModel(f"config.json for '{model_type}' is missing or has a bad value: {e}") from None


def load_spec(folder: Path) -> ModelSpec:
    return spec_from_config(read_config(folder))


def build_graph(spec: ModelSpec):
    """The verified IR graph of a spec, as its family builds it (before passes): the shared
    pre-norm decoder over the family's weight map unless the family builds its own."""
    fam = family(spec.model_type)
    own = getattr(fam, "build_graph", None)
    return own(spec) if own is not None else build_decoder(spec, weight_names(spec))


def hf_architecture(spec: ModelSpec) -> str:
    """The transformers class name an exported config.json declares."""
    return family(spec.model_type).HF_ARCHITECTURES[spec.model_type]


def gguf_layout(spec: ModelSpec) -> GgufLayout:
    return family(spec.model_type).GGUF


def weight_names(spec: ModelSpec) -> dict[str, str]:
    """IR roles to the checkpoint's tensor names (`{i}` for the layer): the family's canonical Hugging
    Face names, under the spec's `weight_prefix` where a multimodal checkpoint keeps its language model."""
    names = family(spec.model_type).weight_names(spec)
    return {role: spec.weight_prefix + name for role, name in names.items()}


__all__ = ["FAMILIES", "FAMILY_CONTRACT", "MODEL_TYPES", "ModelSpec", "GgufLayout", "build_graph", "family", "gguf_layout", "hf_architecture", "load_spec", "spec_from_config", "weight_names"]
