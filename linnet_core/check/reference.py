"""The reference: `transformers` in eager mode, prefill then teacher-forced greedy decode steps."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import FORMATS
from ..errors import BackendUnavailable
from ..models import build_graph

if TYPE_CHECKING:  # the annotations' only use of torch: imported where the reference loads
    import torch


@dataclass
class ReferenceRun:
    logits: np.ndarray  # float32 [T + steps, V]: prefill positions, then one row per decode step
    tokens: list[int]  # greedy tokens: after the prompt, then after each step (steps + 1)


def quiet_transformers() -> None:
    """Keep transformers' progress bars and advice off a command's stderr."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def load_reference(path: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, dtype), attn_implementation="eager", use_safetensors=True
        )
    except Exception as e:  # noqa: BLE001 - transformers raises many types (even AssertionError) for one meaning
        raise BackendUnavailable(f"transformers cannot load {path} as the reference: {e}".splitlines()[0]) from None
    return model.eval()


def rounding_cache(model, dtype: str):
    """transformers' own KV cache for `model`, holding each key and value rounded to `dtype` (where a
    backend keeps its cache narrower than its activations) and handing them back widened."""
    import torch
    from transformers import DynamicCache

    cache, narrow = DynamicCache(config=model.config), getattr(torch, dtype)
    update = cache.update

    def rounded(keys, values, layer_idx, *args, **kwargs):  # what attention reads: the stored numbers
        return update(keys.to(narrow).to(keys.dtype), values.to(narrow).to(values.dtype), layer_idx, *args, **kwargs)

    cache.update = rounded
    return cache


def run_reference(model, prompt: list[int], steps: int, feed: list[int] | None = None,
                  kv_cache_dtype: str | None = None) -> ReferenceRun:
    """Prefill, then `steps` decode steps fed the model's own greedy tokens, or `feed` when given
    (teacher forcing: another model's logits are then compared position by position).
    `kv_cache_dtype`: the KV cache held in that dtype, as the backend checked holds it."""
    import warnings

    import torch

    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cache-API deprecations differ across transformers releases
        past = rounding_cache(model, kv_cache_dtype) if kv_cache_dtype else None
        out = model(torch.tensor([prompt]), past_key_values=past, use_cache=True)
        rows = [out.logits[0].float()]
        past = out.past_key_values
        tokens = [int(rows[-1][-1].argmax())]
        for k in range(steps):
            nxt = feed[k] if feed is not None else tokens[-1]
            out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            rows.append(out.logits[0].float())
            tokens.append(int(rows[-1][-1].argmax()))
    return ReferenceRun(torch.cat(rows).numpy(), tokens)


def reference_dtype(spec, dtype: str) -> str:
    """The reference's dtype: float32 wherever the model fits in memory in float32 (it then holds
    only the reference: backends and exports load after it is freed), else the run's own half
    precision, so a 7B model in bfloat16 is checked on a 24 GiB machine. (While converting a
    half-precision checkpoint, the mapped file's pages count in its RSS too, 22.9 GiB for
    Qwen3-4B; they are clean page cache the kernel reclaims, so only the float32 copy must fit.)"""
    from ..memory import GIB, available_bytes, weight_bytes  # imports torch: not at start-up

    free = available_bytes()
    if free is None or weight_bytes(spec, "float32") + GIB < free:
        return "float32"
    return "float16" if dtype in ("float16", "f16", "fp16") else "bfloat16"  # q8_0 and f32 exports too


def as_quantized(model, spec, fmt: str, activations: str = "float32") -> None:
    """Replace, in place, each weight Linnet stores block-quantized under `fmt` by its dequantized
    blocks: the reference then computes on the very numbers the backend does, so their distance is
    the kernels' error alone, not quantization's. `activations="int8"`: the linear layers over those
    weights also round their inputs to int8 blocks first, as kernels that compute so do."""
    import torch

    from ..params import expert_stacks  # imports torch: not at start-up
    from ..quant import dequantize, int8_blocks, param_formats, quantize  # imports torch: not at start-up

    graph = build_graph(spec)
    formats = param_formats(graph, fmt)
    named = dict(model.named_parameters(remove_duplicate=False))
    stacks = expert_stacks(graph)
    fused = _fused_experts(named) if stacks else {}
    done: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for full, p, layer in graph.all_params():
            if not FORMATS[formats[full]].quantized:
                continue
            local = full.split(".", 2)[-1]
            for k, src in enumerate(p.sources(layer)):
                if src in done:
                    continue
                w = named.get(src)
                if w is None and local in stacks:
                    w = _expert_view(fused, layer, local, k)
                if w is None:
                    raise BackendUnavailable(f"the reference has no weight '{src}' to quantize as {formats[full]}")
                w.copy_(dequantize(quantize(w.float(), formats[full]), formats[full]).to(w.dtype))
                done[src] = w
    if activations == "int8":
        quantized = {w.data_ptr() for w in done.values()}
        for module in model.modules():  # a head tied to the table shares its weight
            if isinstance(module, torch.nn.Linear) and module.weight.data_ptr() in quantized:
                module.register_forward_pre_hook(lambda _, args: (int8_blocks(args[0]), *args[1:]))


def _fused_experts(named: dict) -> dict[tuple[int, str], "torch.Tensor"]:
    """transformers' own layout of each layer's experts, {(layer, "gate_up_proj" | "down_proj"): weight}:
    one `gate_up_proj` [E, 2F, H], gate rows first, and one `down_proj` [E, H, F]."""
    found = {name: re.search(r"layers\.(\d+)\..*\bexperts\.(gate_up_proj|down_proj)$", name) for name in named}
    return {(int(m[1]), m[2]): named[name] for name, m in found.items() if m}


def _expert_view(fused: dict, layer: int, role: str, expert: int):
    """Expert `expert`'s matrix of `role` in the layer's fused experts (_fused_experts), or None."""
    gate_or_up = role in ("ffn_gate_exps.weight", "ffn_up_exps.weight")
    w = fused.get((layer, "gate_up_proj" if gate_or_up else "down_proj"))
    if w is None:
        return None
    w = w[expert]
    if not gate_or_up:
        return w
    half = w.shape[0] // 2
    return w[:half] if role == "ffn_gate_exps.weight" else w[half:]


def reference_run(path: Path, prompt: list[int], steps: int, dtype: str = "float32",
                  feed: list[int] | None = None, quantized: tuple | None = None) -> ReferenceRun:
    """Load the reference, run it, and free it before returning: only the logits stay.
    `quantized` = (spec, format): the reference over the dequantized weights of that format."""
    import gc

    model = load_reference(path, dtype)
    if quantized is not None:
        as_quantized(model, *quantized)
    try:
        return run_reference(model, prompt, steps, feed)
    finally:
        del model
        gc.collect()
