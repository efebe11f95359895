"""The reference: `transformers` in eager mode, prefill then teacher-forced greedy decode steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import BackendUnavailable


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


def run_reference(model, prompt: list[int], steps: int, feed: list[int] | None = None) -> ReferenceRun:
    """Prefill, then `steps` decode steps fed the model's own greedy tokens, or `feed` when given
    (teacher forcing: another model's logits are then compared position by position)."""
    import warnings

    import torch

    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cache-API deprecations differ across transformers releases
        out = model(torch.tensor([prompt]), use_cache=True)
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
