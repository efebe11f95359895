"""Automatic prefix caching and the step budget: reused positions change no output, and a step with
decoding rows carries no more prompt tokens than the budget allows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from linnet_core.compile import load_model
from linnet_core.runtime.sampling import SamplingParams
from linnet_core.serve.engine import Engine, GenerationRequest
from linnet_core.runtime.row_contents import RowContents
from linnet_core.runtime.session import Chunk
from linnet_core.serve.prefix_cache import MIN_COPY, PrefixCache
from linnet_core.serve.step_budget import StepBudget

from family_fixtures import HAVE
from test_engine import run_alone

CASE = "qwen2-bias-tied"
CACHE = 96
SYSTEM = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101, 103,
          107, 109, 113, 127, 131, 137, 139, 149, 151]  # 33 tokens: no multiple of any block size


# Ragged steps (torch, ONNX Runtime) and a compiled backend's dense steps (inductor).
@pytest.fixture(scope="module", params=["torch"] + ["onnxruntime"] * HAVE["onnxruntime"]
                + [pytest.param("inductor", marks=pytest.mark.slow)])
def model(request, tokenized_checkpoints):
    path = tokenized_checkpoints[CASE]
    batched, _ = load_model(path, request.param, "float32", CACHE, rows=3)
    alone, _ = load_model(path, request.param, "float32", CACHE, rows=1)
    return batched, alone


def drain(engine: Engine) -> None:
    while not engine.idle():
        engine.step()


def seeded(i: int) -> SamplingParams:
    return SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_k=30, seed=100 + i)


# -- the row index ------------------------------------------------------------------------
def test_a_free_row_holding_the_prefix_is_taken_and_the_least_recently_used_is_evicted():
    rows = RowContents(rows=3, cache_len=64)
    c = PrefixCache(rows)
    row, reused, source = c.place([1, 2, 3, 4], free=[0, 1, 2], busy=[])
    assert (row, reused, source) == (0, 0, None)  # the lowest row first, as before prefix caching
    rows.wrote(row, 0, [1, 2, 3, 4, 5])  # the prompt and one generated token
    again, reused, source = c.place([1, 2, 3, 9, 9], free=[0, 1, 2], busy=[])
    assert (again, reused, source) == (row, 3, None)  # a partial match, in place
    whole, reused, _ = c.place([1, 2, 3, 4, 5, 6], free=[0, 1, 2], busy=[])
    assert (whole, reused) == (row, 5)  # the generated token is part of what a chat's next turn shares
    capped, reused, _ = c.place([1, 2, 3, 4], free=[0, 1, 2], busy=[])
    assert reused == 3  # the prompt's last token is always computed: its logits choose the first new one
    miss, reused, _ = c.place([50, 51], free=[0, 1, 2], busy=[])
    assert reused == 0 and miss == 1  # a miss evicts the least recently used content, not the match


def test_a_busy_row_s_prefix_is_copied_only_when_it_is_long_enough():
    rows = RowContents(rows=2, cache_len=64)
    c = PrefixCache(rows)
    rows.wrote(0, 0, list(range(40)))
    assert c.place(list(range(40)) + [99], free=[1], busy=[0]) == (1, 40, 0)
    rows.copied(0, 1, 40)
    assert rows.shared(1, np.arange(40)) == 40
    _, _, source = c.place(list(range(MIN_COPY - 1)) + [99], free=[1], busy=[0])
    assert source is None  # fewer than MIN_COPY positions beyond the free row's own match


def test_the_session_keeps_its_rows_contents_whoever_writes(model):
    """Written by any caller, invalidated from a failed step's start on, carried by a copy."""
    batched, _ = model
    contents = batched.row_contents
    batched.prefill(list(range(3, 23)), slot=1)
    assert contents.shared(1, np.arange(3, 23)) == 20
    batched.copy_prefix(1, 2, 12)
    assert contents.valid[2] == 12 and contents.shared(2, np.arange(3, 23)) == 12
    with pytest.raises(Exception):
        batched.step([Chunk([5] * 4, 10, 1), Chunk([1], CACHE, 0)])  # the second does not fit the row
    assert contents.valid[1] == 20  # refused before running: nothing written
    batched._run_chunks = lambda chunks: (_ for _ in ()).throw(RuntimeError("injected"))
    try:
        with pytest.raises(RuntimeError):
            batched.step([Chunk([5] * 4, 10, 1)])
    finally:
        del batched._run_chunks
    assert contents.valid[1] == 10  # positions from the failed chunk's start are gone


def test_the_step_budget_bounds_a_mixed_step_and_lifts_when_nobody_decodes():
    b = StepBudget(max_chunk=256, stall=2.0)
    assert b.prompt_tokens(decoding=4) == 256  # nothing measured yet
    b.observe(0, 4, 0.030)  # a decode-only step: 30 ms
    b.observe(100, 4, 0.130)  # 100 prompt tokens added 100 ms
    assert b.prompt_tokens(decoding=4) == 30  # (2 - 1) x 30 ms at 1 ms a token
    assert b.prompt_tokens(decoding=0) == 256
    assert StepBudget(256, None).prompt_tokens(8) == 256
    assert b.cost() == pytest.approx((0.026, 0.001))
    for _ in range(40):  # mixed steps alone, the machine now twice as slow: the fit follows them
        b.observe(50, 4, 0.160)
        b.observe(20, 4, 0.100)
    assert b.prompt_tokens(decoding=4) == pytest.approx(30, abs=1)  # (2 - 1) x (52 + 4 x 2) ms at 2 ms a token
    assert StepBudget(256, 2.0).prompt_tokens(4) == 256 and StepBudget(64, 10.0).prompt_tokens(1) <= 64
    # More rows waiting for their prompts than decoding: the bound grows by that ratio
    assert b.prompt_tokens(decoding=3, prefilling=6) == pytest.approx(2 * 29, abs=3)  # (52 + 3 x 2) ms / 2 ms x 2
    assert b.prompt_tokens(decoding=2, prefilling=6) == 4 * 256  # three times as many: as if nobody decoded
    # Every decoding row ends within four steps: prompt work waits for them; else it goes on
    assert b.prompt_tokens(decoding=4, prefilling=1, draining_in=4) == 0
    assert b.prompt_tokens(decoding=4, prefilling=1, draining_in=5) == pytest.approx(30, abs=1)
    # ... or before 200 waiting prompt tokens would be through at 30 a step (7 steps)
    assert b.prompt_tokens(decoding=4, prefilling=1, draining_in=7, pending=200) == 0
    assert b.prompt_tokens(decoding=4, prefilling=1, draining_in=8, pending=200) == pytest.approx(30, abs=1)
    # Nobody decoding: every waiting prompt advances a chunk, four at most
    assert b.prompt_tokens(decoding=0, prefilling=3) == 3 * 256 and b.prompt_tokens(0, 8) == 4 * 256
    with pytest.raises(ValueError):
        StepBudget(256, 0.5)


# -- the engine ---------------------------------------------------------------------------
def test_a_shared_prefix_is_reused_and_changes_no_output(model):
    batched, alone = model
    engine = Engine(batched, None, prefill_chunk=8)
    first = engine.submit(GenerationRequest(SYSTEM + [200, 201], 5, ignore_eos=True))
    drain(engine)
    reqs = [GenerationRequest(SYSTEM + [210 + i] * (i + 1), 6, seeded(i), ignore_eos=True) for i in range(4)]
    handles = [engine.submit(r) for r in reqs]
    drain(engine)
    m = engine.metrics
    assert m.prefix_queries == 5 and m.prefix_hits >= 4 and m.prefix_reused_tokens >= 4 * len(SYSTEM)
    assert first.result()[1] == run_alone(alone, first.request.prompt, 5)
    for r, h in zip(reqs, handles, strict=True):
        assert h.result()[1] == run_alone(alone, r.prompt, r.max_tokens, r.sampling)


def test_outputs_are_identical_with_and_without_prefix_caching(model):
    batched, _ = model
    rng = random.Random(3)
    reqs = []
    for i in range(12):  # shared system prompts of two kinds, chat-like extensions, and misses
        head = SYSTEM if i % 3 else SYSTEM[:20]
        tail = [rng.randrange(3, 380) for _ in range(rng.randrange(1, 12))]
        prompt = head + tail if i % 4 else tail + head
        reqs.append(GenerationRequest(prompt, rng.randrange(2, 12), seeded(i), ignore_eos=True))
    outputs = {}
    for caching in (False, True):
        engine = Engine(batched, None, prefill_chunk=8, prefix_caching=caching)
        handles = []
        for r in reqs:  # arriving while others run, so rows are busy, freed and taken again
            handles.append(engine.submit(r))
            engine.step()
        drain(engine)
        outputs[caching] = [h.result()[1] for h in handles]
        if caching:
            assert engine.metrics.prefix_hits > 0
    assert outputs[True] == outputs[False]


def test_a_prefix_being_filled_is_copied_to_a_request_that_shares_it(model):
    batched, alone = model
    engine = Engine(batched, None, prefill_chunk=8, decode_stall=None)
    long_prompt = SYSTEM + list(range(200, 230))
    a = engine.submit(GenerationRequest(long_prompt, 4, ignore_eos=True))
    for _ in range(3):  # 24 of its positions written
        engine.step()
    b = engine.submit(GenerationRequest(SYSTEM[:30] + [300, 301], 5, seeded(0), ignore_eos=True))
    engine.step()
    assert engine.metrics.prefix_reused_tokens >= MIN_COPY  # copied from the row still filling
    drain(engine)
    assert a.result()[1] == run_alone(alone, long_prompt, 4)
    assert b.result()[1] == run_alone(alone, b.request.prompt, 5, seeded(0))


def test_cancel_mid_prefill_of_a_shared_prefix_leaves_the_others_whole(model):
    batched, alone = model
    engine = Engine(batched, None, prefill_chunk=8, decode_stall=None)
    a = engine.submit(GenerationRequest(SYSTEM + list(range(200, 240)), 4, ignore_eos=True))
    engine.step()
    engine.step()
    b = engine.submit(GenerationRequest(SYSTEM + [300], 5, ignore_eos=True))
    engine.step()
    a.cancel()  # its row is freed with 16-24 positions of the prefix written
    c = engine.submit(GenerationRequest(SYSTEM + [301, 302], 5, seeded(1), ignore_eos=True))
    drain(engine)
    assert a.result()[2] == "cancelled"
    assert b.result()[1] == run_alone(alone, b.request.prompt, 5)
    assert c.result()[1] == run_alone(alone, c.request.prompt, 5, seeded(1))
    assert sorted(engine._free) == [0, 1, 2]


def test_a_prefix_evicted_while_another_request_extends_it(model):
    """Three rows, each taken by a miss in turn: the row holding the prefix is evicted while a
    request that copied it goes on extending its own copy."""
    batched, alone = model
    engine = Engine(batched, None, prefill_chunk=64, decode_stall=None)
    holder = engine.submit(GenerationRequest(SYSTEM + [250], 30, ignore_eos=True))
    engine.step()  # prefilled: the prefix is in its row, which keeps decoding
    extender = engine.submit(GenerationRequest(SYSTEM + [260, 261, 262], 20, ignore_eos=True))
    engine.step()  # copied from the busy row
    holder.cancel()
    engine.step()
    misses = [engine.submit(GenerationRequest([5 + i, 6, 7, 8], 3, ignore_eos=True)) for i in range(3)]
    drain(engine)  # the holder's row went to a miss
    assert extender.result()[1] == run_alone(alone, extender.request.prompt, 20)
    for h in misses:
        assert h.result()[1] == run_alone(alone, h.request.prompt, 3)
    assert engine.metrics.prefix_reused_tokens >= len(SYSTEM)


def test_a_step_with_decoding_rows_keeps_to_the_budget(model, monkeypatch):
    batched, alone = model
    engine = Engine(batched, None, prefill_chunk=32)
    monkeypatch.setattr(engine.budget, "prompt_tokens", lambda decoding, *_: 5 if decoding else 32)
    seen = []
    real = batched.step_tokens

    def step(chunks):
        seen.append(chunks)
        return real(chunks)

    monkeypatch.setattr(batched, "step_tokens", step)
    reqs = [GenerationRequest(list(range(10 + i, 50 + i)), 8, ignore_eos=True) for i in range(5)]
    handles = [engine.submit(r) for r in reqs]
    drain(engine)
    for r, h in zip(reqs, handles, strict=True):
        assert h.result()[1] == run_alone(alone, r.prompt, 8)
    mixed = 0
    for chunks in seen:
        decode = [c for c in chunks if len(c.ids) == 1 and c.start >= 40]  # every prompt is 40 tokens
        prompt_tokens = sum(len(c.ids) for c in chunks if c not in decode)
        assert prompt_tokens <= (5 if decode else 32)
        mixed += bool(decode and prompt_tokens)
    assert mixed > 0  # the load did mix prompt work with decoding rows


def _recording(batched, monkeypatch) -> list:
    """The chunks of every step the session runs from now on."""
    seen, real = [], batched.step_tokens

    def step(chunks):
        seen.append([(len(c.ids), c.start, c.slot) for c in chunks])
        return real(chunks)

    monkeypatch.setattr(batched, "step_tokens", step)
    return seen


def test_prompt_work_waits_for_decoding_rows_about_to_end(model, monkeypatch):
    batched, alone = model
    engine = Engine(batched, None, prefill_chunk=64)
    engine.budget.observe(0, 2, 0.030)  # a fitted budget, as after a few steps: 1 ms a prompt token
    engine.budget.observe(20, 2, 0.050)
    first = [engine.submit(GenerationRequest([5 + i] * 10, 4, ignore_eos=True)) for i in range(2)]
    engine.step()  # both prompts in one step: nobody decodes yet
    engine.step()  # token 2 of 4 each: two steps left
    late = engine.submit(GenerationRequest([9] * 12, 3, ignore_eos=True))
    seen = _recording(batched, monkeypatch)
    drain(engine)
    shapes = [sorted((n, start) for n, start, _ in step) for step in seen]
    assert shapes[:3] == [[(1, 11), (1, 11)], [(1, 12), (1, 12)], [(12, 0)]]  # the prompt waits for them, then goes
    assert [h.result()[1] for h in first + [late]] == [run_alone(alone, h.request.prompt, h.request.max_tokens)
                                                       for h in first + [late]]


def test_requests_arriving_in_a_burst_are_admitted_together(model, monkeypatch):
    import time

    batched, alone = model
    engine = Engine(batched, None, prefill_chunk=64, burst_wait=(0.2, 2.0)).start()
    try:
        seen = _recording(batched, monkeypatch)
        reqs = [GenerationRequest([20 + i] * (6 + i), 3, ignore_eos=True) for i in range(3)]
        handles = []
        for r in reqs:  # 50 ms apart: within the quiet time, so one burst
            handles.append(engine.submit(r))
            time.sleep(0.05)
        results = [h.result()[1] for h in handles]
    finally:
        engine.stop(timeout=10)
    assert sorted(n for n, start, _ in seen[0]) == [6, 7, 8]  # the three prompts in the first step
    assert all(len(step) == 3 and all(n == 1 for n, _, _ in step) for step in seen[1:])  # then in step
    assert results == [run_alone(alone, r.prompt, 3) for r in reqs]
    off = Engine(batched, None, burst_wait=(0.0, 0.0))  # --burst-wait 0: a request goes at once
    off.submit(reqs[0])
    started = time.monotonic()
    off._await_burst()
    assert time.monotonic() - started < 0.05
    drain(off)


def test_requests_arriving_together_compute_their_shared_prefix_once(model):
    """Three requests with one long system prompt, admitted in the same step: the oldest fills it,
    the others copy it once it is there instead of computing it again."""
    batched, alone = model
    engine = Engine(batched, None, prefill_chunk=16, decode_stall=None)
    system = SYSTEM + list(range(200, 240))  # 73 tokens
    reqs = [GenerationRequest(system + [300 + i, 301], 4, seeded(i), ignore_eos=True) for i in range(3)]
    computed = []
    real = batched.step_tokens

    def step(chunks):
        computed.append(sum(len(c.ids) for c in chunks if len(c.ids) > 1 or c.start < len(system)))
        return real(chunks)

    batched.step_tokens = step
    try:
        handles = [engine.submit(r) for r in reqs]
        drain(engine)
    finally:
        del batched.step_tokens
    for r, h in zip(reqs, handles, strict=True):
        assert h.result()[1] == run_alone(alone, r.prompt, 4, r.sampling)
    # The prefix once (but a tail shorter than MIN_COPY, which the others compute beside it), then each
    # request's own few tokens
    assert sum(computed) < len(system) + 2 * MIN_COPY + 3 * 8
    assert engine.metrics.prefix_hits == 2 and engine.metrics.prefix_reused_tokens >= 2 * (len(system) - 16)


@pytest.mark.skipif(not HAVE["jax"], reason="jax is not installed")
def test_a_copied_prefix_continues_as_computed_on_jax(tokenized_checkpoints):
    """XLA's cache is immutable and donated: the copy is one compiled whole-row update."""
    path = tokenized_checkpoints[CASE]
    batched, _ = load_model(path, "jax", "float32", CACHE, rows=2)
    alone, _ = load_model(path, "jax", "float32", CACHE, rows=1)
    prompt = SYSTEM + [250, 251, 252]
    assert batched.row_contents.valid.sum() == 0  # recorded from here on
    batched.prefill(SYSTEM + [240], slot=0)
    batched.copy_prefix(0, 1, len(SYSTEM))
    batched.prefill([5, 6, 7], slot=0)  # row 0 holds something else now: only the copy has the prefix
    engine = Engine(batched, None, prefill_chunk=16)
    handle = engine.submit(GenerationRequest(prompt, 5, ignore_eos=True))
    drain(engine)
    assert engine.metrics.prefix_reused_tokens == len(SYSTEM)
    assert handle.result()[1] == run_alone(alone, prompt, 5)
