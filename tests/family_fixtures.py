"""Tiny random checkpoints of every family and feature, made by `transformers` itself.

Each case is a real config class of its family, scaled down; nothing here touches a network.
The test suite (conftest.py) and the GPU pass (scripts/gpu_pass.py) build the same ones.
"""

from __future__ import annotations

import importlib.util
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

TOKENIZED_VOCAB = 384
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=160, max_position_embeddings=256)


@dataclass(frozen=True)
class Case:
    id: str
    config_class: str
    kwargs: dict = field(default_factory=dict)
    legacy: bool = False  # rewrite config.json in the pre-v5 style
    shard: bool = False
    tokenizer: str = "spm"  # the style of tokenizer its export fixture ships (tests/tokenizer_fixtures.py)


CASES = [
    Case("llama-gqa-untied", "LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    Case("llama-mha-tied-legacy", "LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4,
                                                      tie_word_embeddings=True), legacy=True),
    Case("llama-llama3-rope", "LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32)), tokenizer="llama3"),
    Case("llama-linear-rope-legacy-sharded", "LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                           factor=2.0)), legacy=True, shard=True),
    Case("mistral-window", "MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 sliding_window=8)),
    Case("qwen2-bias-tied", "Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                                tie_word_embeddings=True), tokenizer="qwen2"),
    Case("qwen3-headdim128", "Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                                 tie_word_embeddings=True), tokenizer="qwen2"),
    Case("qwen3-legacy-untied", "Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
         legacy=True, tokenizer="qwen2"),
    Case("phi3-fused-window", "Phi3Config", dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=8,
                                                 pad_token_id=0)),
    Case("granite-multipliers", "GraniteConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                                      embedding_multiplier=4.0, residual_multiplier=0.5,
                                                      attention_multiplier=0.3, logits_scaling=2.0)),
    Case("olmo2-post-norms", "Olmo2Config", dict(num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                                                 eos_token_id=2)),
    Case("smollm3-nope", "SmolLM3Config", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                                              pad_token_id=0, bos_token_id=1, eos_token_id=2), tokenizer="llama3"),
    Case("gemma2-softcaps", "Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 query_pre_attn_scalar=16, sliding_window=8,
                                                 attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Case("gemma3-local-global", "Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        num_hidden_layers=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,  # layers 0-4 slide, 5 is full
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    Case("qwen3moe-experts", "Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                    num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    norm_topk_prob=True), tokenizer="qwen2"),
    Case("mixtral-experts", "MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                                  num_experts_per_tok=2)),
    Case("phi3-partial-rotary-gqa", "Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                            partial_rotary_factor=0.5))),
]
CASE_IDS = [c.id for c in CASES]
# Backends every fixture is checked on here (the optional ones when their extra is installed),
# and the half dtypes each runs on this CPU.
HAVE = {name: importlib.util.find_spec(name) is not None for name in ("onnxruntime", "jax")}


def _needs_kernels():
    import pytest

    from linnet_core.backends.cpu import extension

    return pytest.mark.skipif(extension.extension() is None,
                              reason=f"Linnet's CPU kernels do not run here: {extension.why_not()}")


needs_kernels = _needs_kernels()  # q8_0 / q4_0 on a CPU: AVX-512 with VNNI and BF16
CPU_BACKENDS = ["torch", "inductor"] + ["onnxruntime"] * HAVE["onnxruntime"] + ["jax", "stablehlo"] * HAVE["jax"]
HALF_DTYPES = [("torch", "float16"), ("torch", "bfloat16"), ("inductor", "bfloat16")] \
    + [("onnxruntime", "float16")] * HAVE["onnxruntime"] + [("jax", "bfloat16"), ("stablehlo", "bfloat16")] * HAVE["jax"]
FAMILY_CASES = ["llama-gqa-untied", "mistral-window", "qwen2-bias-tied", "qwen3-headdim128", "phi3-fused-window",
                "granite-multipliers", "olmo2-post-norms", "smollm3-nope", "gemma2-softcaps", "gemma3-local-global",
                "qwen3moe-experts", "mixtral-experts"]


def make_multimodal_gemma3(folder: Path, vocab_size: int) -> Path:
    """gemma-3-4b-it's layout at test size: Gemma3ForConditionalGeneration, a vision tower beside the
    language model, the decoder's settings under text_config and its tensors under language_model."""
    import torch
    import transformers

    text = {**SMALL, **next(c for c in CASES if c.id == "gemma3-local-global").kwargs, "vocab_size": vocab_size}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=vocab_size - 4, boi_token_index=vocab_size - 3,
                                       eoi_token_index=vocab_size - 2)
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.eval().save_pretrained(folder)
    return folder


def to_legacy(cfg: dict) -> dict:
    """The pre-transformers-5 spelling of a config: rope_theta / rope_scaling / torch_dtype."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters", None) or {})
    if "full_attention" in rope:  # by layer type: the full layers' rope, and the sliding layers' base
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = dict(rope["full_attention"])
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    partial = rope.pop("partial_rotary_factor", None)
    if partial is not None:
        cfg["partial_rotary_factor"] = partial
    kind = rope.pop("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def make_checkpoint(case: Case, folder: Path, **overrides) -> Path:
    import torch
    import transformers

    config = getattr(transformers, case.config_class)(**{**SMALL, **case.kwargs, **overrides})
    torch.manual_seed(zlib.crc32(case.id.encode()))
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random init is tiny; widen it so logits differ visibly between tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.eval().save_pretrained(folder, max_shard_size="60KB" if case.shard else "10GB")
    if case.legacy:
        path = folder / "config.json"
        path.write_text(json.dumps(to_legacy(json.loads(path.read_text())), indent=2))
    return folder
