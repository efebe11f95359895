"""Session.step: decode rows and prompt chunks of other rows in one step leave every row exactly
as if it had run alone (its tokens, and its cache: the logits of one more token)."""

from __future__ import annotations

import pytest
import torch

from linnet_core.compile import load_model
from linnet_core.errors import InputError
from linnet_core.runtime.session import Chunk

from family_fixtures import CPU_BACKENDS, FAMILY_CASES

CACHE = 48
NEW = 5
CHUNK = 5
# Row r starts at step r; lengths cover a one-token prompt, a prompt shorter than a chunk, and
# prompts of several chunks, so steps mix decode tokens with chunks of different lengths.
PROMPTS = [[7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30 + i for i in range(12)], [44]]


def run_mixed(session) -> tuple[list[list[int]], int]:
    """Every row through `Session.step`, staggered; (tokens per row, steps taken)."""
    prefilled, out, steps = [0] * len(PROMPTS), [[] for _ in PROMPTS], 0
    while any(len(o) < NEW for o in out):
        chunks, rows = [], []
        for r, prompt in enumerate(PROMPTS):
            if r > steps or len(out[r]) >= NEW:
                continue
            if prefilled[r] < len(prompt):
                ids = prompt[prefilled[r]:prefilled[r] + CHUNK]
                chunks.append(Chunk(ids, prefilled[r], r))
            else:
                chunks.append(Chunk([out[r][-1]], len(prompt) + len(out[r]) - 1, r))
            rows.append(r)
        for r, chunk, token in zip(rows, chunks, session.step(chunks), strict=True):
            if prefilled[r] < len(PROMPTS[r]):
                prefilled[r] += len(chunk.ids)
                if prefilled[r] < len(PROMPTS[r]):
                    continue
            out[r].append(token)
        steps += 1
    return out, steps


def probe(session, slot: int, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits after feeding the last token once more at its position (reads the whole cache row)."""
    return torch.from_numpy(session.prefill([tokens[-1]], slot=slot, start=len(prompt) + len(tokens) - 1,
                                            logits="last").logits)


# The ragged steps (ONNX Runtime's graph, the generated PyTorch) on every family (windows, GQA,
# partial rotary, fused weights); the backends that take a step as one call per chunk length on
# one family each.
RAGGED = [b for b in ("onnxruntime", "torch") if b in CPU_BACKENDS]
PAIRS = [(backend, case) for backend in RAGGED for case in FAMILY_CASES] \
    + [(backend, "mistral-window") for backend in CPU_BACKENDS if backend not in RAGGED]


@pytest.mark.parametrize("backend,case", PAIRS)
def test_mixed_steps_leave_every_row_as_if_alone(backend, case, checkpoints):
    mixed, _ = load_model(checkpoints[case], backend, "float32", CACHE, rows=len(PROMPTS))
    alone, _ = load_model(checkpoints[case], backend, "float32", CACHE, rows=1)
    calls = []
    device_call = {"onnxruntime": "_call", "torch": "step_fn"}.get(backend)
    if device_call:  # count the calls the ragged backends make
        real = getattr(mixed, device_call)
        setattr(mixed, device_call, lambda *a, **k: calls.append(1) or real(*a, **k))
    got, steps = run_mixed(mixed)
    if device_call:
        setattr(mixed, device_call, real)
        assert len(calls) == steps  # a ragged step is one call, decode rows and chunks alike
    for r, prompt in enumerate(PROMPTS):
        want = [alone.prefill(prompt, slot=0).tokens[0]]
        while len(want) < NEW:
            want.append(alone.decode([want[-1]], [len(prompt) + len(want) - 1], [0]).tokens[0])
        assert got[r] == want, f"row {r}"
        torch.testing.assert_close(probe(mixed, r, prompt, got[r]), probe(alone, 0, prompt, want),
                                   atol=2e-5, rtol=1e-5)


def test_a_step_refuses_overlapping_or_out_of_range_chunks(checkpoints):
    session, _ = load_model(checkpoints["qwen2-bias-tied"], "torch", "float32", 16, rows=2)
    for chunks, message in (([], "at least one chunk"), ([Chunk([], 0, 0)], "no chunk may be empty"),
                            ([Chunk([1], 0, 0), Chunk([2, 3], 0, 0)], "same cache row twice"),
                            ([Chunk([1] * 10, 8, 1)], "do not fit the cache length 16"),
                            ([Chunk([1], 0, 2)], "cache row 2 is out of range")):
        with pytest.raises(InputError, match=message):
            session.step(chunks)
