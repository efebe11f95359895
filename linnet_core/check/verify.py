"""verify: a backend against the reference on the same tokens, with a distance and a verdict.

Distance from reference = the largest absolute logit difference over the prefill positions and
N teacher-forced decode steps (both sides are fed the reference's greedy tokens). Top-1
agreement is reported beside it. The tolerance depends on the dtype and scales with the size of
the reference logits, since a rounding error is relative to the number rounded.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..backends import get_backend
from ..compile import Model, compile_model, load_model, open_model
from ..dtypes import FORMATS, compute_dtype
from ..errors import InputError
from ..gguf.llamacpp_reference import llamacpp_activations, run_llamacpp
from ..memory import check_fits
from .agreement import compare_logits, tolerance_for
from .prompts import prompt_ids, text_ids
from .quant_effect import measure
from .reference import as_quantized, load_reference, reference_dtype, run_reference


@dataclass
class VerifyReport:
    model: str
    backend: str
    dtype: str
    prompt_tokens: int
    steps: int
    distance: float
    tolerance: float
    top1_agreement: float
    tokens_match: bool
    passed: bool
    reference_dtype: str  # float32 unless the model is too big for that here
    activations: str  # what the kernels hold activations in for a matmul: the compute dtype, or int8
    reference_tokens: list[int]
    backend_tokens: list[int]
    artifact: str
    seconds: float
    quantization: dict | None = None  # quantized weights: their effect against the float model (quant_effect)

    def to_json(self) -> dict:
        return asdict(self)


def _transformers_reference(m: Model, ids: list[int], steps: int, compiled, activations: str, reference,
                            kv_cache_dtype: str):
    """transformers on the checkpoint (over the dequantized blocks for a quantized dtype, its KV cache
    held as the backend holds it), and for one the original model's logits over a real text: (run,
    its dtype, original, text, text ids)."""
    ref_dtype = "float32" if reference is not None else reference_dtype(m.spec, compiled.dtype)
    quantized = FORMATS[compiled.dtype].quantized
    effect_text, effect_ids, original = None, [], None
    if quantized:
        effect_text, effect_ids = text_ids(m, compiled.cache_len)
    ref_model = reference if reference is not None else load_reference(m.path, ref_dtype)
    try:
        if quantized:  # the original model over a real text (quantization's own cost), then, over the
            original = run_reference(ref_model, effect_ids, 0)  # same dequantized weights, the kernels' error
            if ref_model is reference:  # a copy: the caller's model stays as it was
                ref_model = copy.deepcopy(ref_model)
            as_quantized(ref_model, m.spec, compiled.dtype, activations)
        narrow = kv_cache_dtype if kv_cache_dtype != compute_dtype(compiled.dtype) else None
        return run_reference(ref_model, ids, steps, kv_cache_dtype=narrow), ref_dtype, original, effect_text, effect_ids
    finally:
        del ref_model
        gc.collect()


def verify(model: str | Path | Model | None, backend: str = "torch", dtype: str = "float32", steps: int = 8,
           prompt: str | None = None, cache_len: int | None = None, reference=None, **load_kw) -> VerifyReport:
    """Run reference and backend on the same tokens; `reference` may pass a loaded transformers model."""
    t0 = time.perf_counter()
    m = model if isinstance(model, Model) else open_model(model, load_kw.pop("revision", None))
    ids = prompt_ids(m, prompt)
    if steps < 1:
        raise InputError(f"--steps must be at least 1, got {steps}")
    need = len(ids) + steps
    compiled = compile_model(m, backend, dtype, cache_len,
                             **{k: v for k, v in load_kw.items() if k in ("cache", "progress")})
    if need > compiled.cache_len:
        raise InputError(f"the prompt and {steps} steps need {need} positions; the cache has {compiled.cache_len}")
    be = get_backend(compiled.backend)  # refused now, from the sizes, rather than after the reference ran
    device = load_kw.get("device") or be.default_device()
    activations = be.activations(compiled.dtype, device)
    check_fits(m.spec, be, compiled.dtype, compiled.cache_len, 1, device)
    # The reference first, then the backend: only the reference's logits are kept in between, so a
    # model as big as memory allows is never held twice.
    original = effect_text = None
    if m.is_gguf:  # the file's own engine is its reference: llama.cpp on the same bytes
        ref = run_llamacpp(m.path, ids, steps)
        weights = m.config.get("gguf_weights", "F32")
        ref_dtype = f"llama.cpp ({weights} weights)"
        ref_activations = llamacpp_activations(m.spec, weights)
    else:
        ref, ref_dtype, original, effect_text, effect_ids = _transformers_reference(
            m, ids, steps, compiled, activations, reference, be.kv_cache_dtype(compiled.dtype))
        ref_activations = "float32" if ref_dtype == "float32" else ref_dtype
    session, compiled = load_model(m, backend, dtype, cache_len, rows=1, **load_kw)

    got = [session.prefill(ids, logits="all")]
    for k in range(steps):
        got.append(session.decode([ref.tokens[k]], [len(ids) + k], [0], logits=True))
    logits = np.concatenate([g.logits[0] for g in got])  # [T + steps, V]
    tokens = [g.tokens[0] for g in got]
    distance, tolerance, top1 = compare_logits(logits, ref.logits, activations)
    if ref_activations != "float32":  # the reference rounds too: two errors, not one, the larger twice
        tolerance = 2 * max(tolerance, tolerance_for(ref.logits, ref_activations))
    effect = None
    if original is not None:
        got_text = session.prefill(effect_ids, logits="all").logits[0]  # [T, V]
        effect = measure(original.logits, got_text, effect_ids, compiled.dtype, effect_text)
    return VerifyReport(
        model=m.resolved.name, backend=compiled.backend, dtype=compiled.dtype, prompt_tokens=len(ids), steps=steps,
        distance=distance, tolerance=tolerance, top1_agreement=top1, tokens_match=tokens == ref.tokens,
        passed=bool(distance <= tolerance and (effect is None or effect.passed)), reference_dtype=ref_dtype,
        activations=activations,
        reference_tokens=ref.tokens, backend_tokens=tokens,
        artifact=str(compiled.artifact), seconds=time.perf_counter() - t0,
        quantization=effect.to_json() if effect else None,
    )
