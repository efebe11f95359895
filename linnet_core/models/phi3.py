"""Phi-3: fused `qkv_proj` and `gate_up_proj` in the checkpoint, partial rotary, sliding window."""

from __future__ import annotations

from .decoder import GgufLayout, hf_llama_style_names
from .spec import ModelSpec, common_spec

MODEL_TYPE = "phi3"
ALIASES = ()
HF_ARCHITECTURES = {"phi3": "Phi3ForCausalLM"}
# llama.cpp keeps Phi-3's fused gate/up matrix under the name of the up projection. A name with
# "phi3" in it makes its vocabulary loader set attributes on these four tokens by text (token_to_id.at:
# "unordered_map::at" when one is missing, as in a byte-level BPE vocabulary).
GGUF = GgufLayout("phi3", renames={"ffn_gate_up": "ffn_up"},
                  name_needs_tokens=(("phi3", "phi-3"), ("</s>", "<unk>", "<s>", "<|endoftext|>")))


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    return common_spec(cfg, model_type, MODEL_TYPE, qkv_bias=False, o_bias=False, mlp_bias=False)


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return hf_llama_style_names(spec, fused_qkv=True, fused_gate_up=True)
