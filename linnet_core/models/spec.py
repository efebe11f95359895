"""ModelSpec: a decoder-only checkpoint's config, normalised across families and config styles.

Family modules fill it from `config.json`; everything downstream (graph builders, emitters,
exports) reads only this. Both config styles are read here once: transformers 5
(`rope_parameters`, `dtype`) and older (`rope_theta`, `rope_scaling` with `type`/`rope_type`,
`torch_dtype`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..dtypes import normalize_format
from ..errors import CheckpointError, UnsupportedModel

# freq_factors: each inverse frequency divided by its own factor, as a GGUF carries llama3 scaling
# (llama.cpp's rope_freqs tensor); no config.json spells it.
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass(frozen=True)
class RopeSpec:
    type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    freq_factors: tuple[float, ...] = ()  # type freq_factors: one divisor per inverse frequency


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # as the config names it (an alias such as "mistral" stays visible)
    family: str  # the module that handles it
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...]  # sliding window per layer; None = full causal
    hidden_act: str = "silu"
    qk_norm: bool = False
    qk_norm_over: str = "head"  # "head": each head's features; "projection": the whole q / k projection
    no_rope_layers: tuple[int, ...] = ()  # layers whose attention takes no rope (NoPE)
    embedding_scale: float = 1.0  # the token table's rows times this
    residual_scale: float = 1.0  # each block branch's output times this before it joins the residual
    attention_scale: float | None = None  # the scores' scale; None: 1 / sqrt(head_dim)
    logit_scale: float = 1.0  # the logits times this
    norm_weight_offset: float = 0.0  # each norm scales by its weight plus this (Gemma: 1)
    attention_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    logit_softcap: float | None = None  # the logits likewise
    sliding_rope: RopeSpec | None = None  # the rope of sliding-window layers, where theirs differs (Gemma 3)
    weight_prefix: str = ""  # before every tensor name: a multimodal checkpoint's language model
    num_experts: int = 0  # a mixture of experts' MLPs per layer; 0: one dense MLP
    experts_per_token: int = 0  # the router's top-k
    expert_intermediate_size: int = 0  # each expert's MLP width
    normalize_expert_weights: bool = True  # the top-k's weights rescaled to sum to 1
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"  # the checkpoint's stored dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelSpec":
        """The spec `to_json` wrote (lists back to tuples, the rope back to its record)."""
        def rope(r: dict | None) -> RopeSpec | None:
            return None if r is None else RopeSpec(**{**r, "freq_factors": tuple(r.get("freq_factors", ()))})

        return cls(**{**d, "rope": rope(d["rope"]), "sliding_rope": rope(d.get("sliding_rope")),
                      "layer_windows": tuple(d["layer_windows"]), "eos_token_ids": tuple(d["eos_token_ids"]),
                      "no_rope_layers": tuple(d.get("no_rope_layers", ()))})


def require(cfg: dict, *keys: str) -> Any:
    """The first of `keys` present in the config; refuse the config by name when none is."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise UnsupportedModel(f"config.json has no '{keys[0]}'", hint="is this a decoder-only LLM checkpoint?")


def positive_int(cfg: dict, *keys: str, default: int | None = None, most: int = 1 << 24) -> int:
    """`require` for a count or a size: a positive integer up to `most` (an integral float such as
    32.0 passes, as JSON writers emit them), else the config is refused by name in one line."""
    value = require(cfg, *keys) if default is None else next(
        (cfg[k] for k in keys if cfg.get(k) is not None), default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or not 1 <= value <= most:
        raise CheckpointError(f"config.json: '{keys[0]}' must be an integer from 1 to {most}, got {str(value)[:40]}",
                              hint="the config is damaged or not a model's config")
    return int(value)


def finite(value: Any, name: str, *, above: float = 0.0, at_most: float = math.inf) -> float:
    """A config number: finite and in (above, at_most], else refused by name in one line (a NaN would
    reach the generated source and every logit)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not above < value <= at_most:
        limit = f" and at most {at_most:g}" if at_most < math.inf else ""
        raise CheckpointError(f"config.json: '{name}' must be a finite number above {above:g}{limit}, "
                              f"got {str(value)[:40]}", hint="the config is damaged or not a model's config")
    return float(value)


def read_dtype(cfg: dict) -> str:
    """The stored weights' format: a float dtype, or a GGUF source's q8_0 / q4_0 blocks."""
    return normalize_format(cfg.get("dtype") or cfg.get("torch_dtype") or "float32") or "float32"


def read_rope(cfg: dict) -> RopeSpec:
    """Rope settings from either config style; unknown rope types are refused by name."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    merged = {**legacy, **params}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type '{kind}' is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    spec = RopeSpec(type=kind, theta=finite(theta, "rope_theta", above=1.0),
                    partial_rotary_factor=finite(partial, "partial_rotary_factor", at_most=1.0))
    if kind == "linear":
        spec = RopeSpec(**{**asdict(spec), "factor": finite(merged.get("factor"), "rope_scaling.factor")})
    elif kind == "llama3":
        try:
            spec = RopeSpec(
                **{
                    **asdict(spec),
                    **{k: finite(merged[k], f"rope_scaling.{k}")
                       for k in ("factor", "low_freq_factor", "high_freq_factor")},
                    "original_max_position_embeddings": positive_int(
                        {"original_max_position_embeddings": merged.get("original_max_position_embeddings")
                         or cfg.get("max_position_embeddings")}, "original_max_position_embeddings"),
                }
            )
        except KeyError as e:
            raise UnsupportedModel(f"llama3 rope scaling lacks '{e.args[0]}' in config.json") from None
    elif kind == "freq_factors":
        spec = RopeSpec(**{**asdict(spec), "freq_factors": tuple(finite(f, "rope_scaling.freq_factors")
                                                                 for f in merged.get("freq_factors", ()))})
    return spec


def read_windows(cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """Sliding window per layer, from `layer_types` when present, else from `sliding_window`."""
    window = positive_int(cfg, "sliding_window") if cfg.get("sliding_window") is not None else None
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types[:num_layers])
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    return (window,) * num_layers


def windows_from_max_window_layers(cfg: dict, num_layers: int) -> tuple[int | None, ...] | None:
    """Windows of configs that slide only when `use_sliding_window` is set, and then only from
    layer `max_window_layers` on; None when `layer_types` says it instead (read_windows reads that)."""
    if cfg.get("layer_types"):
        return None
    if not cfg.get("use_sliding_window"):
        return (None,) * num_layers
    first = int(cfg.get("max_window_layers", num_layers))
    window = positive_int(cfg, "sliding_window")
    return tuple(window if i >= first else None for i in range(num_layers))


def read_eos(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"config.json: 'eos_token_id' must be a token id or a list of them, got {str(eos)[:40]}",
                              hint="the config is damaged or not a model's config")
    return tuple(ids)


def read_experts(cfg: dict, intermediate_size: int) -> dict[str, Any]:
    """Mixture-of-experts fields, from either name of the expert count (Qwen's `num_experts`, Mixtral's
    `num_local_experts`); {} for a dense model."""
    if not cfg.get("num_experts") and not cfg.get("num_local_experts"):
        return {}
    count = positive_int(cfg, "num_experts", "num_local_experts", most=1 << 12)
    return dict(num_experts=count, experts_per_token=positive_int(cfg, "num_experts_per_tok", most=count),
                expert_intermediate_size=positive_int(cfg, "moe_intermediate_size", default=intermediate_size),
                normalize_expert_weights=bool(cfg.get("norm_topk_prob", True)))


def common_spec(cfg: dict, model_type: str, family: str, **overrides: Any) -> ModelSpec:
    """The fields every supported family reads the same way; families override the rest."""
    hidden = positive_int(cfg, "hidden_size")
    heads = positive_int(cfg, "num_attention_heads")
    layers = positive_int(cfg, "num_hidden_layers", most=1 << 12)  # 30x the deepest model: loops stay short
    fields: dict[str, Any] = dict(
        model_type=model_type,
        family=family,
        vocab_size=positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=positive_int(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=positive_int(cfg, "num_key_value_heads", default=heads),
        head_dim=positive_int(cfg, "head_dim", default=max(1, hidden // heads)),
        rms_norm_eps=finite(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", at_most=1.0),
        rope=read_rope(cfg),
        max_position_embeddings=positive_int(cfg, "max_position_embeddings", default=2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        weight_prefix=str(cfg.get("weight_prefix", "")),
        layer_windows=read_windows(cfg, layers),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        dtype=read_dtype(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=read_eos(cfg),
    )
    fields.update(read_experts(cfg, fields["intermediate_size"]))
    fields.update(overrides)
    spec = ModelSpec(**fields)
    if spec.num_heads % spec.num_kv_heads:
        raise UnsupportedModel(f"{spec.num_heads} attention heads do not divide into {spec.num_kv_heads} KV heads")
    if spec.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
        raise UnsupportedModel(f"activation '{spec.hidden_act}' is not supported (supported: silu, gelu)")
    return spec
