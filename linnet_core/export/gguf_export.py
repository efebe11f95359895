"""`linnet export gguf`: one GGUF file for llama.cpp, written from the IR's params.

The IR already names weights by llama.cpp's tensor roles (`blk.{i}.attn_q.weight`); a family's
`GgufLayout` says what else differs (its architecture key, renamed roles, q/k rows permuted for
llama.cpp's interleaved rope). Tensors are converted and written one at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..check.roundtrip import check_gguf, require_gguf_consumer
from ..compile import Model, open_model
from ..dtypes import FORMATS, normalize_format
from ..errors import BackendUnavailable, InputError, UnsupportedModel
from ..gguf.reader import read_gguf
from ..gguf.schema import Metadata, Vocabulary
from ..gguf.tokenizer import read_vocabulary
from ..gguf.vocab import GgufVocab, read_vocab, vocab_from_gguf
from ..ir.rope import inv_freq
from ..models import GgufLayout, build_graph, gguf_layout
from ..models.spec import ModelSpec, RopeSpec
from ..params import expert_stacks, materialize, release_sources
from ..quant import param_formats, quantize
from ..tokenizer import Tokenizer, read_chat_template
from ..weights import Checkpoint
from . import ExportResult, output_file, summarize

GGUF_FORMATS = ("float32", "float16", "bfloat16", "q8_0", "q4_0")  # the storage formats this export writes
GGUF_DTYPES = tuple(FORMATS[f].gguf for f in GGUF_FORMATS)  # as llama.cpp names them: f32 ... q8_0


def require_gguf():
    try:
        import gguf
    except ImportError:
        raise BackendUnavailable("writing GGUF needs the gguf package", hint="pip install 'linnet[gguf]'") from None
    return gguf


def pick_gguf_dtype(dtype: str, spec: ModelSpec) -> str:
    """llama.cpp's name of the storage format asked for (any spelling dtypes.py knows)."""
    if dtype == "auto":
        return FORMATS[spec.dtype].gguf
    fmt = normalize_format(dtype)
    if fmt not in GGUF_FORMATS:
        raise InputError(f"unknown GGUF dtype '{dtype}' (choose from: auto, {', '.join(GGUF_DTYPES)})")
    return FORMATS[fmt].gguf


def permute_for_interleaved_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [heads * head_dim, ...] from rotate-half order to llama.cpp's adjacent pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_freq_factors(spec: ModelSpec) -> np.ndarray:
    """llama3 scaling (or a GGUF's own factors) as llama.cpp takes it: per-frequency divisors of the
    unscaled rope [rotary_dim / 2]."""
    rope = asdict(spec.rope)
    base = inv_freq({**rope, "type": "default"}, spec.rotary_dim)
    scaled = inv_freq(rope, spec.rotary_dim)
    return np.array([b / s for b, s in zip(base, scaled, strict=True)], dtype=np.float32)


@dataclass
class _Tensor:
    """One GGUF tensor: its name and ggml type, how the writer declares it, and a function that
    makes its data when it is written (bf16 and block-quantized types as raw bytes)."""

    name: str
    qtype: object
    declared_shape: tuple[int, ...]  # in elements, or in bytes for raw types
    declared_dtype: np.dtype
    nbytes: int
    raw: bool
    make: Callable[[], np.ndarray]


def _plan(spec: ModelSpec, layout: GgufLayout, ckpt: Checkpoint, dtype: str, gguf) -> list[_Tensor]:
    Q = gguf.GGMLQuantizationType
    graph = build_graph(spec)  # unfused: one param per checkpoint tensor, named by llama.cpp role
    fmt = normalize_format(dtype)
    # A quantized export stores each weight as a Linnet artifact of that dtype does (quant.py), block
    # for block the same bytes; a float one casts every matrix and keeps vectors in f32.
    formats = param_formats(graph, fmt) if FORMATS[fmt].quantized else None
    stacks = expert_stacks(graph)
    plan: list[_Tensor] = []
    for full, p, layer in graph.all_params():
        if full == "output.weight" and spec.tie_word_embeddings:
            continue  # llama.cpp uses token_embd for a missing output head
        role = full.split(".", 2)[-1] if layer is not None else full
        base, _, suffix = role.rpartition(".")
        gname = f"blk.{layer}.{layout.renames.get(base, base)}.{suffix}" if layer is not None else full
        heads = spec.num_heads if base == "attn_q" else spec.num_kv_heads if base == "attn_k" else None
        permute = layout.rope_interleaved and heads is not None

        # an expert stack [E * rows, cols] is llama.cpp's 3-d [E, rows, cols] (ffn_*_exps)
        shape = (stacks[role], p.shape[0] // stacks[role], p.shape[1]) if layer is not None and role in stacks \
            else p.shape

        def weight(p=p, layer=layer, heads=heads, permute=permute, shape=shape) -> torch.Tensor:
            w = materialize(p, layer, ckpt, torch.float32).clone()  # its own memory: the source can go
            release_sources(p, layer, ckpt)
            return (permute_for_interleaved_rope(w, heads) if permute else w).reshape(shape)

        if formats is not None:
            qtype = Q[FORMATS[formats[full]].gguf.upper()]
        else:
            qtype = Q.F32 if len(p.shape) == 1 else Q[dtype.upper()]
        plan.append(_tensor(gname, shape, qtype, weight, gguf))
    if spec.rope.type in ("llama3", "freq_factors"):  # llama.cpp's spelling of both
        factors = rope_freq_factors(spec)
        plan.append(_tensor("rope_freqs.weight", factors.shape, Q.F32, lambda: torch.from_numpy(factors), gguf))
    return plan


def _tensor(name: str, shape: tuple[int, ...], qtype, weight: Callable[[], torch.Tensor], gguf) -> _Tensor:
    Q = gguf.GGMLQuantizationType
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nbytes = int(np.prod(shape)) // block * block_bytes
    raw = qtype in (Q.BF16, Q.Q8_0, Q.Q4_0)

    def make() -> np.ndarray:
        w = weight()
        if qtype == Q.F32:
            return w.float().numpy()
        if qtype == Q.F16:
            return w.half().numpy()
        if qtype == Q.BF16:  # torch rounds to nearest even, as ggml does
            return w.bfloat16().view(torch.uint8).numpy()
        return quantize(w, qtype.name.lower()).numpy()  # the artifact's quantizer: the same blocks

    if raw:
        return _Tensor(name, qtype, gguf.quants.quant_shape_to_byte_shape(shape, qtype), np.dtype(np.uint8), nbytes,
                       True, make)
    return _Tensor(name, qtype, tuple(shape), np.dtype(np.float32 if qtype == Q.F32 else np.float16), nbytes, False,
                   make)


def gguf_context_length(spec: ModelSpec) -> int:
    """The context a GGUF declares. Outside the architectures whose sliding layers llama.cpp knows
    (`sliding_every`), llama.cpp attends over the whole context where a checkpoint slides a window,
    so the two agree only up to the smallest window: that is the context declared."""
    windows = [x for x in spec.layer_windows if x] if not gguf_layout(spec).sliding_every else []
    return min([spec.max_position_embeddings] + windows)


def check_spellable(spec: ModelSpec) -> None:
    """Refuse, before anything is written, a model whose GGUF llama.cpp would run otherwise than Linnet."""
    layout = gguf_layout(spec)

    def refuse(what: str):
        raise UnsupportedModel(f"{what}, which no GGUF of llama.cpp's {layout.arch} can say", hint="export hf keeps it")

    fixed = layout.no_rope_layers(spec.num_layers)
    if spec.no_rope_layers != fixed:
        refuse(f"llama.cpp leaves rope out of layers {list(fixed) or 'none'}; this model leaves it out of "
               f"{list(spec.no_rope_layers)}")
    windows = {w for w in spec.layer_windows if w}
    if layout.sliding_every and windows:
        want = tuple(next(iter(windows)) if s else None for s in layout.sliding_layers(spec.num_layers))
        if len(windows) > 1 or spec.layer_windows != want:
            refuse(f"the model slides windows {list(spec.layer_windows)} by layer, not llama.cpp's fixed pattern")
    if spec.sliding_rope is not None and spec.sliding_rope != RopeSpec(theta=layout.sliding_rope_theta or 0.0):
        refuse("the sliding layers' rope is not llama.cpp's fixed one")
    if (spec.attention_scale is not None and "attention.scale" not in layout.config_keys
            and not math.isclose(spec.attention_scale, spec.head_dim ** -0.5)):
        refuse(f"an attention scale of {spec.attention_scale:g}, not 1/sqrt(head_dim)")
    if spec.num_experts and not spec.normalize_expert_weights:
        refuse("experts weighted as the softmax gave them (norm_topk_prob false), where llama.cpp renormalizes them")
    caps = {"attn_logit_softcapping": spec.attention_softcap, "final_logit_softcapping": spec.logit_softcap}
    for key, cap in caps.items():
        if cap is not None and key not in layout.config_keys:
            refuse(f"a soft cap ({key})")


def _metadata(w, spec: ModelSpec, layout: GgufLayout, vocab: GgufVocab, dtype: str, name: str, gguf,
              config: dict) -> None:
    w.add_context_length(gguf_context_length(spec))
    w.add_embedding_length(spec.hidden_size)
    w.add_block_count(spec.num_layers)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.rotary_dim)
    w.add_rope_freq_base(spec.rope.theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_vocab_size(spec.vocab_size)
    if len(set(spec.layer_windows)) == 1 and spec.layer_windows[0]:  # one window for every layer: declared, so
        w.add_sliding_window(spec.layer_windows[0])                   # a GGUF read back slides it too
    elif layout.sliding_every and any(spec.layer_windows):  # llama.cpp's own layer pattern (check_spellable)
        w.add_sliding_window(next(x for x in spec.layer_windows if x))
    if spec.sliding_rope is not None:
        w.add_rope_freq_base_swa(spec.sliding_rope.theta)
    if spec.num_experts:
        w.add_expert_count(spec.num_experts)
        w.add_expert_used_count(spec.experts_per_token)
        w.add_expert_feed_forward_length(spec.expert_intermediate_size)
    if spec.rope.type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope.factor)
    for key, config_key in layout.config_keys.items():  # the family's numbers (parse_config checked them)
        if config.get(config_key) is not None:
            w.add_float32(f"{layout.arch}.{key}", float(config[config_key]))
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    words, needed = layout.name_needs_tokens
    if not any(word in name.lower() for word in words) or all(t in vocab.tokens for t in needed):
        w.add_name(name)


def _write_vocab(w, vocab: GgufVocab) -> None:
    w.add_tokenizer_model(vocab.model)
    if vocab.pre:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    if vocab.add_space_prefix is not None:
        w.add_add_space_prefix(vocab.add_space_prefix)


def _vocab(w, folder: Path, vocab: GgufVocab, gguf) -> None:
    _write_vocab(w, vocab)
    special = gguf.SpecialVocab(folder, load_merges=vocab.model == "gpt2", n_vocab=len(vocab.tokens))
    special.chat_template = None  # written below from the files Linnet itself reads templates from
    ids = special.special_token_ids
    if "pad" not in ids and ("eos" in ids or "unk" in ids):
        # Without one, transformers' GGUF loader falls back to its config class's default pad id,
        # which can lie outside a smaller vocabulary (32000 for one family) and break the embedding.
        ids["pad"] = ids.get("eos", ids.get("unk"))
    if "bos" not in special.add_special_token and "bos" in ids:
        # Said outright: llama.cpp's default differs by vocabulary (a Llama 3 one gets BOS unless told).
        special.add_special_token["bos"] = Tokenizer(folder).encode("a")[:1] == [ids["bos"]]
    special.add_to_gguf(w, quiet=True)
    template = read_chat_template(folder)
    if template:
        w.add_chat_template(template)


# A GGUF model's tokenizer keys written again as they are (its vocabulary goes through GgufVocab).
# The source vocabulary's settings copied as they are: its field -> the writer's method
COPIED_TOKENIZER_KEYS = {"bos": "add_bos_token_id", "eos": "add_eos_token_id", "unknown": "add_unk_token_id",
                         "padding": "add_pad_token_id", "add_bos": "add_add_bos_token", "add_eos": "add_add_eos_token"}


def _vocab_from_source(w, vocab: GgufVocab, source: Vocabulary) -> None:
    _write_vocab(w, vocab)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    for field, add in COPIED_TOKENIZER_KEYS.items():
        if getattr(source, field) is not None:
            getattr(w, add)(getattr(source, field))
    if source.chat_template is not None:
        w.add_chat_template(source.chat_template)


def write_gguf(model: Model, path: Path, dtype: str, progress: Callable[[str], None] | None = None) -> None:
    gguf = require_gguf()
    import logging

    logging.getLogger("gguf").setLevel(logging.WARNING)  # the writer logs every step at INFO
    spec = model.spec
    layout = gguf_layout(spec)
    name = model.resolved.name.rstrip("/").split("/")[-1]
    if model.is_gguf:  # another format of a GGUF model: its vocabulary and tokenizer keys as they are

        with read_gguf(model.path) as source:
            source_vocab, name = read_vocabulary(source), Metadata(source).string("general.name", None)
        vocab, name = vocab_from_gguf(source_vocab), name or model.path.stem
    else:
        vocab = read_vocab(model.path, spec.vocab_size)
    plan = _plan(spec, layout, model.checkpoint(), dtype, gguf)
    w = gguf.GGUFWriter(None, layout.arch)
    _metadata(w, spec, layout, vocab, dtype, name, gguf, model.config)
    if model.is_gguf:
        _vocab_from_source(w, vocab, source_vocab)
    else:
        _vocab(w, model.path, vocab, gguf)
    for t in plan:
        w.add_tensor_info(t.name, t.declared_shape, t.declared_dtype, t.nbytes, raw_dtype=t.qtype if t.raw else None)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    try:
        for k, t in enumerate(plan, 1):
            w.write_tensor_data(t.make())
            if progress and k % 32 == 0:
                progress(f"{k}/{len(plan)} tensors")
        w.flush()
    finally:
        w.close()


def export_gguf(model: str | Path | Model | None, out: Path, dtype: str = "auto", force: bool = False,
                revision: str | None = None, check: bool = True, consumer: str | None = None,
                on_check=None) -> ExportResult:
    """Write `out` (one .gguf file); with `check`, load it back in llama.cpp (or transformers)
    before it appears under its name. A failed check leaves nothing at `out`."""
    started = time.perf_counter()
    m = model if isinstance(model, Model) else open_model(model, revision)
    dt = pick_gguf_dtype(dtype, m.spec)
    check_spellable(m.spec)
    require_gguf()
    if check:
        require_gguf_consumer(m.spec, consumer)
    report = None
    with output_file(Path(out), force) as tmp:
        write_gguf(m, tmp, dt)
        read_gguf(tmp).close()  # Linnet's own reader must accept what it wrote
        if check:
            report = check_gguf(m, tmp, dt, consumer)
            if on_check:
                on_check(report)
            report.raise_if_failed(Path(out))
    result = summarize(Path(out), started)
    result.check = report
    if gguf_context_length(m.spec) < m.spec.max_position_embeddings:
        result.notes.append(f"context_length is {gguf_context_length(m.spec)}, the model's sliding window: "
                            "llama.cpp attends over the whole context, so it agrees with the checkpoint only that far")
    return result

