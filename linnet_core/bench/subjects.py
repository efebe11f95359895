"""What a bench measures: the method, and the sides (Linnet backends and the comparators).

A side that cannot run here is kept with the one-line reason, so the table lists it as missing
instead of silently dropping it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..backends import BACKEND_NAMES, get_backend
from ..dtypes import FORMATS
from ..errors import BackendUnavailable, InputError
from . import llama_server

if TYPE_CHECKING:
    from ..speculation import SpeculationOptions

BASELINE = "transformers"
# key -> (label, stack, what it is, for the notes column)
COMPARATORS = {
    "transformers": ("transformers", "PyTorch", "the reference: eager, its dynamic KV cache (q8_0/q4_0: float32 "
                                                "over the dequantized blocks)"),
    "transformers-compiled": ("transformers, compiled", "PyTorch",
                              "its forward under torch.compile (fullgraph) over a static cache; "
                              "its load time includes the compile"),
    "llama.cpp": ("llama.cpp on Linnet's GGUF", "LLM engines",
                  "linnet.export_gguf in the bench dtype (q8_0/q4_0: the artifact's very blocks), then "
                  "llama-cpp-python with its defaults (f16 KV cache); one sequence"),
    "llama-server": ("llama-server on Linnet's GGUF", "LLM engines",
                     "llama.cpp's server (linnet bench --build-llama-server builds the pinned source) on the same "
                     "GGUF, one /completion at a time, its own timings; with --speculate/--draft, its own "
                     "speculative decoding on the same target and draft GGUFs"),
    "vllm": ("vLLM on Linnet's export", "LLM engines", "linnet.export_hf, then vLLM's offline LLM"),
    "sglang": ("SGLang on Linnet's export", "LLM engines", "linnet.export_hf, then SGLang's offline Engine"),
}


@dataclass(frozen=True)
class Method:
    prompt_tokens: int = 512
    new_tokens: int = 128
    batch: int = 1
    runs: int = 10
    warmups: int = 3
    dtype: str = "auto"
    cache_len: int | None = None  # default: prompt + new tokens
    seed: int = 0
    speculation: SpeculationOptions | None = None  # each run decodes with and without it
    prompt_file: str | None = None  # the prompt: this file's text, tokenized (else random token ids)

    def __post_init__(self):
        for name in ("prompt_tokens", "new_tokens", "batch", "runs"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.new_tokens < 2:
            raise InputError("--new-tokens must be at least 2: decode speed is timed after the first token")
        if self.warmups < 0:
            raise InputError(f"--warmups must be 0 or more, got {self.warmups}")
        if self.speculation is not None and self.batch != 1:
            raise InputError("--speculate and --draft measure one sequence: use --batch 1")
        if self.cache_len is not None and self.cache_len < self.prompt_tokens + self.new_tokens:
            raise InputError(f"--cache-len {self.cache_len} cannot hold {self.prompt_tokens} prompt tokens and "
                             f"{self.new_tokens} new ones")

    @property
    def positions(self) -> int:  # a check of k proposals writes up to k positions past the last token
        spare = self.speculation.draft_tokens if self.speculation else 0
        return self.cache_len or self.prompt_tokens + self.new_tokens + spare

    def describe(self) -> str:
        runs = f"{self.runs} run{'s' * (self.runs != 1)}"
        warm = f"{self.warmups} warm-up{'s' * (self.warmups != 1)}"
        spec = self.speculation
        speculative = "" if spec is None else (
            f" · speculative ({'prompt lookup' if spec.chosen == 'ngram' else 'draft ' + str(spec.draft)}, "
            f"{'up to ' if spec.adaptive else ''}{spec.draft_tokens} proposed) against plain, each run")
        source = f" (from {self.prompt_file})" if self.prompt_file else ""
        return (f"{self.prompt_tokens} prompt tokens{source}, {self.new_tokens} new · batch {self.batch} · median of {runs} "
                f"after {warm}{speculative}")

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Subject:
    key: str  # "linnet:torch", "transformers", "llama.cpp", ...
    label: str
    stack: str
    note: str = ""
    backend: str | None = None  # Linnet subjects

    @property
    def is_linnet(self) -> bool:
        return self.backend is not None


def linnet_subject(backend: str) -> Subject:
    b = get_backend(backend)
    return Subject(f"linnet:{backend}", f"Linnet, {b.title}", b.stack, backend=backend)


def comparator(key: str) -> Subject:
    label, stack, note = COMPARATORS[key]
    return Subject(key, label, stack, note)


def pick(backends: list[str], comparators: list[str]) -> list[Subject]:
    """The sides in page order: the reference first, then by stack, Linnet beside its stack's comparators."""
    unknown = [b for b in backends if b not in BACKEND_NAMES]
    if unknown:
        raise InputError(f"unknown backend '{unknown[0]}' (choose from: all, {', '.join(BACKEND_NAMES)})")
    bad = [c for c in comparators if c not in COMPARATORS]
    if bad:
        raise InputError(f"unknown comparator '{bad[0]}' (choose from: all, none, {', '.join(COMPARATORS)})")
    subjects = [comparator(BASELINE)] + [comparator(c) for c in comparators if c != BASELINE]
    subjects += [linnet_subject(b) for b in backends]
    order = {"PyTorch": 0, "JAX": 1, "ONNX Runtime and TensorRT": 2, "LLM engines": 3}
    return sorted(subjects, key=lambda s: (order.get(s.stack, 9), s.is_linnet))


def why_missing(subject: Subject, dtype: str, batch: int, device: str = "cpu") -> str | None:
    """None when the side can run on `device` here, else the one-line reason (and what to install)."""
    if subject.is_linnet:
        try:
            backend = get_backend(subject.backend)
            backend.check_device(device)  # first: "no CUDA provider" says more than "no CPU bf16 kernel"
            backend.check_format(dtype)
            backend.check_available(dtype)
        except BackendUnavailable as e:
            return e.message + (f" ({e.hint})" if e.hint else "")
        return None
    need = {"llama.cpp": [("llama_cpp", "pip install 'linnet[llamacpp]'"), ("gguf", "pip install gguf")],
            "vllm": [("vllm", "pip install vllm")], "sglang": [("sglang", "pip install 'sglang[all]'")]}
    for module, install in need.get(subject.key, []):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({install})"
    if subject.key in ("vllm", "sglang"):
        import torch

        if not torch.cuda.is_available():
            return f"{subject.key} needs a CUDA GPU; none is present here"
    if subject.key in ("vllm", "sglang") and FORMATS[dtype].quantized:
        return f"Linnet's Hugging Face export has no {dtype} weights"
    if subject.key == "llama.cpp" and batch != 1:
        return "llama-cpp-python runs one sequence: batch 1 only"
    if subject.key == "llama-server":
        if device != "cpu":
            return "the llama-server Linnet builds is a CPU build"
        if batch != 1:
            return "llama-server is timed one request at a time: batch 1 only"
        try:
            if llama_server.find() is None:
                return f"llama-server is not on PATH nor built ({llama_server.BUILD_COMMAND_DECODE})"
        except InputError as e:
            return e.message
    return None
