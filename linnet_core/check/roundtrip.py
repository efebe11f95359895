"""Round-trip checks: an export loaded back in the engine it is for, its logits compared with the source's.

The reference is the source checkpoint in transformers (eager, float32). The export's consumer
is fed the same prompt and the reference's greedy tokens (teacher forcing), so every position
compares like with like. Exact and half-precision exports (f32, f16, float16) must stay within the
dtype's logit tolerance; lossier ones (bf16, q8_0) round activations or weights too coarsely for a
logit distance to mean much, so they must pick the reference's top-1 token at >= 90% of positions.
The greedy tokens of the decode steps are reported beside the verdict.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..compile import Model, load_model
from ..dtypes import FORMATS, normalize_dtype, normalize_format
from ..errors import BackendUnavailable, CheckpointError, InputError, VerifyFailed
from ..gguf.llamacpp_reference import LlamaCppRefused, llamacpp, llamacpp_activations, native_stderr_kept, run_llamacpp
from ..gguf.reader import read_gguf
from ..gguf.schema import Metadata
from ..models import gguf_layout
from ..tokenizer import Tokenizer
from .agreement import TOLERANCE, compare_logits, decisive_agreement
from .prompts import prompt_ids
from .reference import ReferenceRun, quiet_transformers, reference_dtype, reference_run, run_reference

# Spaces, digits, punctuation, a newline, a tab and characters a small vocabulary lacks (byte fallback).
SAMPLE_TEXT = 'Hello world! The list object, 123 + 4567 = "x".\n  Indented\tline: naïve café, 東京.'
HF_STEPS = 8
GGUF_STEPS = 16  # decode steps after the prompt
MIN_LOSSY_AGREEMENT = 0.9
GATED_BY_DISTANCE = ("float32", "float16")


class ExportCheckFailed(VerifyFailed):
    """The export did not load back, or computes something else than its source."""

    default_hint = "pass --no-check to write it anyway"


@dataclass
class RoundTrip:
    format: str
    consumer: str
    dtype: str
    prompt_tokens: int
    steps: int
    distance: float
    tolerance: float | None  # None: judged on top-1 agreement (bf16, q8_0)
    top1_agreement: float
    greedy_match: bool  # the decode steps' greedy tokens equal the reference's
    tokenizer_match: bool | None  # None: the source has no tokenizer to compare
    passed: bool

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        limit = (f"<= {self.tolerance:.2g}" if self.tolerance is not None
                 else f"top-1 >= {MIN_LOSSY_AGREEMENT:.0%} where the reference is decisive")
        tok = {None: "", True: ", tokenizer identical", False: ", TOKENIZER DIFFERS"}[self.tokenizer_match]
        verdict = "passed" if self.passed else "FAILED"
        greedy = "same" if self.greedy_match else "different"
        return (f"round trip through {self.consumer}: distance {self.distance:.3g} ({limit}), "
                f"top-1 {self.top1_agreement:.0%} over {self.prompt_tokens} + {self.steps} positions, "
                f"{greedy} greedy tokens{tok}: {verdict}")

    def raise_if_failed(self, out: Path) -> None:
        if not self.passed:
            raise ExportCheckFailed(f"{out} was not written: {self.describe()}",
                                    hint="pass --no-check to write it anyway")


def coarser(a: str, b: str) -> str:
    """Of two roundings, the one with the larger tolerance."""
    return max(a, b, key=lambda r: TOLERANCE.get(r, 1.0))


def _judge(fmt: str, consumer: str, dtype: str, ids, ref, logits: np.ndarray, steps: int,
           tokenizer_match: bool | None, precision: str | None = None) -> RoundTrip:
    """`precision`: the consumer's rounding where it is coarser than the dtype's."""
    precision = normalize_dtype(dtype) if precision is None else coarser(normalize_dtype(dtype), precision)
    if precision in GATED_BY_DISTANCE:
        distance, tolerance, top1 = compare_logits(logits, ref.logits, precision)
        passed = distance <= tolerance
    else:  # the distance is reported, agreement decides
        distance, _, _ = compare_logits(logits, ref.logits, "float32")
        top1 = decisive_agreement(logits, ref.logits, precision)
        tolerance, passed = None, top1 >= MIN_LOSSY_AGREEMENT
    greedy = [int(t) for t in logits[len(ids) - 1:].argmax(-1)] == ref.tokens[:steps + 1]
    return RoundTrip(fmt, consumer, dtype, len(ids), steps, distance, tolerance, top1, greedy,
                     tokenizer_match, bool(passed and tokenizer_match is not False))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _hf_tokenizers_match(source: Path, export: Path, **export_kw) -> bool | None:
    from transformers import AutoTokenizer

    try:  # a GGUF source: the tokenizer Linnet rebuilds from the file, which Linnet's commands use
        want = Tokenizer(source).encode(SAMPLE_TEXT, add_special_tokens=False) if source.is_file() else \
            AutoTokenizer.from_pretrained(str(source)).encode(SAMPLE_TEXT, add_special_tokens=False)
    except (OSError, ValueError, TypeError, CheckpointError):
        return None  # the source has no tokenizer to compare against
    return AutoTokenizer.from_pretrained(str(export), **export_kw).encode(SAMPLE_TEXT, add_special_tokens=False) == want


def check_hf(model: Model, folder: Path, dtype: str) -> RoundTrip:
    """The exported folder in transformers (loaded in float32: the distance is the export's own),
    against the source in transformers, or in llama.cpp for a GGUF source."""
    ids = prompt_ids(model, None)
    ref_dtype = reference_dtype(model.spec, dtype)  # float32 unless too big: then both sides in `dtype`
    rounding = None
    if model.is_gguf:
        ref = run_llamacpp(model.path, ids, HF_STEPS)
        rounding = llamacpp_activations(model.spec, model.config.get("gguf_weights", "F32"))
    else:
        ref = reference_run(model.path, ids, HF_STEPS, ref_dtype)
    got = reference_run(folder, ids, HF_STEPS, ref_dtype, feed=ref.tokens)
    match = _hf_tokenizers_match(model.path, folder)
    return _judge("hf", f"transformers {_version('transformers')}", dtype, ids, ref, got.logits, HF_STEPS, match,
                  rounding)


# The engines that can load a GGUF back, best first, and the modules each needs.
GGUF_CONSUMERS = {"llama.cpp": ("llama_cpp",), "transformers": ("gguf", "accelerate")}
_INSTALL = {"llama.cpp": "pip install 'linnet[llamacpp]'", "transformers": "pip install 'linnet[gguf]'"}


def _missing(consumer: str) -> list[str]:
    import importlib.util

    return [m for m in GGUF_CONSUMERS[consumer] if importlib.util.find_spec(m) is None]


def require_gguf_consumer(spec, consumer: str | None = None) -> str:
    """The engine a GGUF check of `spec`'s export will use: `consumer` if installed, else the best one
    installed; refused before anything is written when it cannot check this model."""
    if consumer is not None and consumer not in GGUF_CONSUMERS:
        raise InputError(f"unknown GGUF checker '{consumer}' (choose from: {', '.join(GGUF_CONSUMERS)})")
    if consumer is None:
        consumer = next((c for c in GGUF_CONSUMERS if not _missing(c)), None)
        if consumer is None:
            raise BackendUnavailable("no engine is installed to check the GGUF with (llama.cpp or transformers)",
                                     hint=f"{_INSTALL['llama.cpp']} or {_INSTALL['transformers']}, or pass --no-check")
    missing = _missing(consumer)
    if missing:
        raise BackendUnavailable(f"checking with {consumer} needs {', '.join(missing)}, which is not installed",
                                 hint=f"{_INSTALL[consumer]}, or pass --no-check")
    if consumer == "transformers" and (gaps := transformers_gguf_gaps(spec)):
        raise BackendUnavailable(f"transformers' GGUF loader does not read back {', '.join(gaps)}, so it cannot "
                                 "check this export", hint=f"check with llama.cpp ({_INSTALL['llama.cpp']})")
    return consumer


def check_gguf(model: Model, file: Path, dtype: str, consumer: str | None = None) -> RoundTrip:
    """The GGUF in llama.cpp (through llama-cpp-python) or, without it, in transformers' GGUF loader."""
    consumer = require_gguf_consumer(model.spec, consumer)
    with read_gguf(file) as g:  # the check stays within the context the file declares
        md = Metadata(g)
        context = md.count(f"{md.string('general.architecture')}.context_length")
    ids = prompt_ids(model, None)
    steps = max(1, min(GGUF_STEPS, context // 2))
    ids = ids[:max(1, context - steps)]
    fmt = normalize_format(dtype)  # quantized: the reference computes on the file's dequantized blocks
    if model.is_gguf:  # another format of a GGUF model: against Linnet on the same weights, in that format
        ref = _linnet_reference(model, ids, steps, fmt)
    else:
        ref = reference_run(model.path, ids, steps, reference_dtype(model.spec, dtype),
                            quantized=(model.spec, fmt) if FORMATS[fmt].quantized else None)
    rounding = None
    if consumer == "llama.cpp":
        logits, match = _run_llamacpp(model, file, ids, ref.tokens[:steps])
        name = f"llama.cpp (llama-cpp-python {_version('llama-cpp-python')})"
        rounding = llamacpp_activations(model.spec, "F32")  # its floor, whatever the file's type
    else:
        try:
            loaded = _load_transformers_gguf(file)
        except Exception as e:  # noqa: BLE001 - its loader raises many types; all mean "cannot load"
            raise ExportCheckFailed(f"transformers cannot load the export ({str(e).splitlines()[0]}); "
                                    "nothing was written", hint="pass --no-check to write it anyway, or check "
                                    f"with llama.cpp ({_INSTALL['llama.cpp']})") from None
        got = run_reference(loaded, ids, steps, feed=ref.tokens)
        logits = got.logits
        match = _hf_tokenizers_match(model.path, file.parent, gguf_file=file.name)
        name = f"transformers {_version('transformers')} (gguf_file=)"
    return _judge("gguf", name, dtype, ids, ref, logits, steps, match, rounding)


def _linnet_reference(model: Model, ids: list[int], steps: int, fmt: str) -> ReferenceRun:
    """Linnet's generated PyTorch over `model` in `fmt` (the blocks an export of that format holds):
    a GGUF model has no transformers checkpoint to be the reference."""
    session, _ = load_model(model, "torch", fmt, cache_len=len(ids) + steps)
    outs = [session.prefill(ids, logits="all")]
    for k in range(steps):
        outs.append(session.decode([outs[-1].tokens[0]], [len(ids) + k], [0], logits=True))
    return ReferenceRun(np.concatenate([o.logits[0] for o in outs]), [o.tokens[0] for o in outs])


def transformers_gguf_gaps(spec) -> list[str]:
    """What transformers' GGUF loader would not read back from this model's GGUF (it rebuilds the
    config from a few keys, so these settings come back as its config class's defaults)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = gguf_layout(spec).arch
    if arch not in GGUF_CONFIG_MAPPING:
        return [f"architecture {arch}"]
    gaps = []
    if spec.num_experts and "expert_count" not in GGUF_CONFIG_MAPPING[arch]:  # read back as a dense model
        gaps.append(f"experts in a {arch} file")
    if spec.rope.type != "default":
        gaps.append(f"{spec.rope.type} rope scaling")
    if spec.rope.partial_rotary_factor != 1.0:
        gaps.append("partial rotary")
    defaults = AutoConfig.for_model(spec.model_type, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads)
    if (getattr(defaults, "head_dim", None) or spec.hidden_size // spec.num_heads) != spec.head_dim:
        gaps.append(f"head_dim {spec.head_dim}")
    return gaps


def _load_transformers_gguf(file: Path):
    import torch
    import transformers.modeling_gguf_pytorch_utils as loader
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    loader.tqdm, saved = (lambda items, **_: items), loader.tqdm  # its tensor loop draws a bar of its own
    try:
        return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    finally:
        loader.tqdm = saved


def _run_llamacpp(model: Model, file: Path, ids: list[int], feed: list[int]) -> tuple[np.ndarray, bool | None]:
    try:
        with llamacpp(file, len(ids) + len(feed)) as llm:
            with native_stderr_kept():
                llm.eval(ids + feed)
            logits = np.array(llm.scores[:len(ids) + len(feed)], dtype=np.float32)  # [T + steps, V]
            try:
                ours = Tokenizer(model.path).encode(SAMPLE_TEXT, add_special_tokens=False)
            except CheckpointError:  # no tokenizer in the source: nothing to compare
                ours = None
            match = None if ours is None else llm.tokenize(SAMPLE_TEXT.encode(), add_bos=False, special=False) == ours
    except LlamaCppRefused as e:
        raise ExportCheckFailed(f"{e.message}; nothing was written",
                                hint="pass --no-check to write it anyway, and report the model: "
                                     "Linnet should have written what llama.cpp reads") from None
    return logits, match
