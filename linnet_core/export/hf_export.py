"""`linnet export hf`: a Hugging Face checkpoint that vLLM, SGLang, TGI and transformers load as is.

Weights are the IR's params under the family's canonical names, cast and written in shards;
`config.json` carries both config styles, because the engines in use read different ones.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from ..check.roundtrip import check_hf
from ..compile import Model, open_model, pick_dtype
from ..dtypes import FORMATS, torch_dtype
from ..errors import InputError, UnsupportedModel
from ..models import build_graph, hf_architecture
from ..models.spec import ModelSpec
from ..params import layout, materialize, release_sources
from ..units import parse_size
from ..weights import write_safetensors
from . import ExportResult, copy_tokenizer, output_folder, summarize

DEFAULT_MAX_SHARD = 5 * 10**9  # bytes, as transformers' "5GB"
INDEX_NAME = "model.safetensors.index.json"


def rope_fields(spec: ModelSpec) -> dict:
    """Rope settings in both spellings: `rope_parameters` (transformers 5) and `rope_theta` /
    `rope_scaling` / `partial_rotary_factor` (the vLLM, SGLang and TGI releases in use). Where the
    sliding layers have a rope of their own, transformers 5 keys both by layer type, and the older
    spelling gives theirs as `rope_local_base_freq`."""
    out = _rope_fields(spec.rope)
    if spec.sliding_rope is not None:
        sliding = _rope_fields(spec.sliding_rope)
        if sliding["rope_scaling"] is not None:
            raise UnsupportedModel("the sliding layers' rope is scaled, which a transformers config cannot spell")
        out["rope_parameters"] = {"full_attention": out["rope_parameters"],
                                  "sliding_attention": sliding["rope_parameters"]}
        out["rope_local_base_freq"] = spec.sliding_rope.theta
    return out


def _rope_fields(r) -> dict:
    if r.type == "freq_factors":
        raise UnsupportedModel("the model's rope is scaled by per-frequency factors (a GGUF's rope_freqs), which "
                               "a transformers config cannot spell", hint="export gguf keeps them; or use the "
                               "Hugging Face checkpoint it was converted from")
    scaling: dict | None = None
    if r.type == "linear":
        scaling = {"factor": r.factor}
    elif r.type == "llama3":
        scaling = {"factor": r.factor, "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
                   "original_max_position_embeddings": r.original_max_position_embeddings}
    params = {"rope_type": r.type, "rope_theta": r.theta, **(scaling or {})}
    out = {"rope_parameters": params, "rope_theta": r.theta,
           "rope_scaling": None if scaling is None else {"type": r.type, "rope_type": r.type, **scaling}}
    if r.partial_rotary_factor != 1.0:
        params["partial_rotary_factor"] = r.partial_rotary_factor
        out["partial_rotary_factor"] = r.partial_rotary_factor
    return out


def hf_config(source: dict, spec: ModelSpec, dtype: str) -> dict:
    """The source config with the fields Linnet understood rewritten in both styles.

    Keys Linnet does not model (pad ids, initializer ranges, ...) pass through unchanged; a multimodal
    source's other towers do not (the export is its language model alone).
    """
    dropped = ("text_config", "vision_config", "audio_config", "_name_or_path", "weight_prefix")
    cfg = {k: v for k, v in source.items() if k not in dropped}
    cfg.update(
        architectures=[hf_architecture(spec)],
        model_type=spec.model_type,
        tie_word_embeddings=spec.tie_word_embeddings,
        dtype=dtype,
        torch_dtype=dtype,
        head_dim=spec.head_dim,
        **rope_fields(spec),
    )
    return cfg


def generation_config(source: Path, spec: ModelSpec) -> dict:
    """The checkpoint's own generation config, or one made from its token ids."""
    path = source / "generation_config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                return data
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    out: dict = {}
    if spec.bos_token_id is not None:
        out["bos_token_id"] = spec.bos_token_id
    if spec.eos_token_ids:
        out["eos_token_id"] = list(spec.eos_token_ids) if len(spec.eos_token_ids) > 1 else spec.eos_token_ids[0]
    return out


def plan_shards(entries: list[tuple[str, tuple[int, ...], object]], max_bytes: int) -> list[list[int]]:
    """Consecutive tensors grouped so that no shard passes `max_bytes` (a larger tensor sits alone)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = _nbytes(shape, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def write_weights(model: Model, out: Path, dtype: str, max_shard_bytes: int) -> None:
    """Shards `model-0000k-of-0000n.safetensors` plus the index that names each tensor's shard."""
    graph = build_graph(model.spec)  # unfused: one param per checkpoint tensor, under its canonical name
    ckpt = model.checkpoint()
    stored, _aliases = layout(graph, dtype)  # a tied head is stored once, as transformers expects
    params = {full: (p, layer) for full, p, layer in graph.all_params()}
    # One entry per source tensor (an expert stack is its experts' matrices), under the family's own
    # names: a multimodal source's language model leaves its prefix behind.
    entries, hf_names, pieces = [], [], []
    for name, shape, dt in stored:
        p, layer = params[name]
        sources = p.sources(layer)
        for k, src in enumerate(sources):
            entries.append((name, (shape[0] // len(sources), *shape[1:]), dt))
            hf_names.append(src.removeprefix(model.spec.weight_prefix))
            pieces.append((k, len(sources)))
    shards = plan_shards(entries, max_bytes=max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for k, members in enumerate(shards, 1):
        # Within a file, the order safetensors' own writer uses (by name): a checkpoint saved by
        # transformers comes back byte-identical in float32, alignment included.
        members = sorted(members, key=lambda i: hf_names[i])
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = [(hf_names[i], entries[i][1], entries[i][2]) for i in members]

        def produce(members=members):
            for i in members:
                p, layer = params[entries[i][0]]
                k, count = pieces[i]
                if count == 1:
                    yield materialize(p, layer, ckpt, torch_dtype(dtype), as_stored=True)
                    release_sources(p, layer, ckpt)  # written: its pages need not stay resident
                else:  # one source of several: read alone
                    src = p.sources(layer)[k]
                    yield ckpt.get(src).to(torch_dtype(dtype))
                    ckpt.release(src)

        write_safetensors(out / fname, tensors, produce(), metadata={"format": "pt"})
        for i in members:
            weight_map[hf_names[i]] = fname
            total += _nbytes(entries[i][1], entries[i][2])
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def export_hf(model: str | Path | Model | None, out: Path, dtype: str = "auto", force: bool = False,
              revision: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD,
              check: bool = True, on_check=None) -> ExportResult:
    """Write the checkpoint to `out`; with `check`, load it back in transformers before `out` appears.

    A failed check raises `ExportCheckFailed` and leaves nothing at `out`.
    """
    started = time.perf_counter()
    m = model if isinstance(model, Model) else open_model(model, revision)
    dt = pick_dtype(dtype, m.spec)
    if FORMATS[dt].quantized:
        raise InputError(f"a Hugging Face checkpoint holds float weights, not {dt} blocks",
                         hint="pass --dtype float32, bfloat16 or float16 (the blocks are dequantized)")
    max_bytes = parse_size(max_shard_size)
    config = hf_config(m.config, m.spec, dt)  # before the weights: a model no config can spell is refused at once
    report = None
    with output_folder(Path(out), force) as tmp:
        write_weights(m, tmp, dt, max_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_tokenizer(m.path, tmp)
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(m.path, m.spec), indent=2) + "\n")
        if check:
            report = check_hf(m, tmp, dt)
            if on_check:
                on_check(report)
            report.raise_if_failed(Path(out))
    result = summarize(Path(out), started)
    result.check = report
    return result

