"""The serving bench's run: every target `rounds` times, interleaved (a shared machine's drift lands on
all of them); each target's row is its median round by output tokens/s, every round's figure beside it."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from ...compile import Model, open_model, pick_dtype
from ...errors import InputError
from ...serve.config import ServeConfig
from ..machine import environment
from .result import ServingResult, with_speedups
from .targets import LABELS, Round, gguf_for_llama_server, measure
from .workload import Workload, round_trippable


def bench_serving(model: str | Path | Model | None, workload: Workload, config: ServeConfig = ServeConfig(),
                  targets: tuple[str, ...] = ("sequential", "engine", "http"), url: str | None = None,
                  api_key: str | None = None, rounds: int = 1,
                  progress: Callable[[str], None] = lambda text: None) -> ServingResult:
    """Measure `targets` (and the server at `url`) on `workload`; every Linnet target runs with `config`
    (its cache length made room for the longest request, its queue for the whole workload)."""
    if rounds < 1:
        raise InputError(f"--rounds must be at least 1, got {rounds}")
    m = model if isinstance(model, Model) else open_model(model)
    config = replace(config, dtype=pick_dtype(config.dtype, m.spec),
                     cache_len=workload.longest_prompt + workload.new_tokens,
                     max_waiting=max(config.max_waiting, workload.requests + 1))
    measured: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="linnet-serving-") as scratch:
        run = Round(m, config, workload, round_trippable(workload, m), Path(scratch), progress)
        if "llama-server" in targets:
            run.gguf = gguf_for_llama_server(run)
        for k in range(rounds):
            for target in targets + (("url",) if url else ()):
                name = url if target == "url" else LABELS[target]
                progress(f"serving bench: {name}" + (f" (round {k + 1} of {rounds})" if rounds > 1 else ""))
                row = measure(target, run, url, api_key)
                row.label = name
                measured.setdefault(target, []).append(row)
    chosen = []
    for runs in measured.values():
        by_speed = sorted(runs, key=lambda r: r.output_tok_s or 0.0)
        row = by_speed[(len(by_speed) - 1) // 2]
        row.rounds_output_tok_s = [r.output_tok_s for r in runs]
        chosen.append(row)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return ServingResult(str(m.resolved.name), config, workload, environment(device), with_speedups(chosen), rounds)
