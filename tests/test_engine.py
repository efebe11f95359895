"""The continuous-batching engine: outputs under load equal the same requests alone, rows come back."""

from __future__ import annotations

import random
import threading

import pytest

from linnet_core.compile import load_model
from linnet_core.errors import InputError
from linnet_core.runtime.generate import Generation
from linnet_core.runtime.sampling import Sampler, SamplingParams
from linnet_core.serve.engine import Engine, EngineFull, EngineUnavailable, GenerationRequest
from linnet_core.tokenizer import Tokenizer

from family_fixtures import HAVE, needs_kernels

CASE = "qwen2-bias-tied"
CACHE = 96


# torch takes a step as one call per chunk length; ONNX Runtime's graph takes it in one ragged call; the
# engine is backend- and format-agnostic, q4_0 weights included.
@pytest.fixture(scope="module", params=["torch", pytest.param("torch:q4_0", marks=needs_kernels)]
                + ["onnxruntime", "onnxruntime:q8_0"] * HAVE["onnxruntime"])
def model(request, tokenized_checkpoints):
    path = tokenized_checkpoints[CASE]
    backend, _, dtype = request.param.partition(":")
    batched, _ = load_model(path, backend, dtype or "float32", CACHE, rows=4)
    alone, _ = load_model(path, backend, dtype or "float32", CACHE, rows=1)
    return batched, alone, Tokenizer(path)


def run_alone(session, prompt, n, params=None):
    gen = Generation(session, prompt, n, sampler=Sampler(params or SamplingParams(), prompt))
    return list(gen)


def requests(n, seed=0, vocab=384):
    """Greedy, seeded, penalised, biased, min-p and log-probability rows, mixed."""
    rng = random.Random(seed)
    kinds = [SamplingParams(), lambda i: SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i),
             SamplingParams(frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3),
             lambda i: SamplingParams(temperature=1.0, min_p=0.05, logit_bias=((7, 2.0), (11, -50.0)), seed=i),
             SamplingParams(logprobs=3)]
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        kind = kinds[i % len(kinds)]
        params = kind(i) if callable(kind) else kind
        out.append(GenerationRequest(prompt, rng.randrange(1, 30), params, ignore_eos=True))
    return out


def test_many_concurrent_requests_match_each_alone(model):
    batched, alone, tok = model
    engine = Engine(batched, tok, prefill_chunk=16).start()
    try:
        reqs = requests(40)
        handles = [None] * len(reqs)

        def submit(i):
            handles[i] = engine.submit(reqs[i])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [h.result() for h in handles]
    finally:
        engine.stop()
    for req, (text, ids, reason) in zip(reqs, results, strict=True):
        assert reason == "length" and len(ids) == req.max_tokens
        # Greedy and seeded sampling alike: the row's computation does not depend on its neighbours.
        assert ids == run_alone(alone, req.prompt, req.max_tokens, req.sampling)
        assert text == tok.decode(ids)
    assert engine.running == 0 and engine.waiting == 0 and sorted(engine._free) == [0, 1, 2, 3]
    assert engine.metrics.tokens_generated == sum(r.max_tokens for r in reqs)


def test_stop_strings_stop_ids_and_eos(model):
    batched, alone, tok = model
    engine = Engine(batched, tok)
    prompt = tok.encode("The list object")
    free, free_ids, _ = _drive(engine, GenerationRequest(prompt, 24, ignore_eos=True))
    assert len(free) > 6
    stop = free[4:7]  # three characters from the middle of the free-running text
    text, ids, reason = _drive(engine, GenerationRequest(prompt, 24, stop=(stop,), ignore_eos=True))
    assert reason == "stop" and text == free[:free.find(stop)] and stop not in text
    at = next(i for i, t in enumerate(free_ids) if t not in free_ids[:i] and i >= 2)
    text, ids, reason = _drive(engine, GenerationRequest(prompt, 24, stop_token_ids=(free_ids[at],),
                                                         ignore_eos=True))
    assert reason == "stop" and ids == free_ids[:at]  # the stop token itself is not emitted
    e2 = Engine(batched, tok, eos_ids={free_ids[0]})
    _, ids, reason = _drive(e2, GenerationRequest(prompt, 24))
    assert reason == "stop" and not ids  # the first token is an end of sequence: nothing is emitted
    _, ids, reason = _drive(e2, GenerationRequest(prompt, 24, ignore_eos=True))
    assert reason == "length" and ids == free_ids


def test_a_failing_step_fails_only_its_culprit(model, monkeypatch):
    """The step is rerun one chunk at a time (its cache writes are idempotent): only the request
    whose chunk fails ends with an error; its neighbours finish as if nothing happened."""
    batched, alone, tok = model
    poison = 377
    real = batched.step_tokens

    def step(chunks):
        if any(poison in c.ids for c in chunks):
            raise RuntimeError("device fault")
        return real(chunks)

    monkeypatch.setattr(batched, "step_tokens", step)
    engine = Engine(batched, tok)
    good = [engine.submit(GenerationRequest([5 + i, 6, 7], 6, ignore_eos=True)) for i in range(2)]
    engine.step()  # the good ones are decoding when the bad one's prompt arrives
    bad = engine.submit(GenerationRequest([9, poison, 11], 6, ignore_eos=True))
    while not engine.idle():
        engine.step()
    last = list(bad)[-1]
    # the client hears that it failed; why (which may name server paths) goes to the server's log
    assert last.finish_reason == "error" and "device fault" not in last.error and "server log" in last.error
    for i, h in enumerate(good):
        assert h.result()[1] == run_alone(alone, [5 + i, 6, 7], 6)


def _drive(engine, request):
    h = engine.submit(request)
    while not engine.idle():
        engine.step()
    return h.result()


def test_cancel_frees_the_row_at_once(model):
    batched, _, tok = model
    engine = Engine(batched, tok)
    long = [engine.submit(GenerationRequest([5, 6, 7], 80, ignore_eos=True)) for _ in range(4)]
    queued = engine.submit(GenerationRequest([8, 9], 5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.running == 4 and engine.waiting == 1
    long[0].cancel()
    engine.step()  # the cancelled row is freed and the queued request takes it in the same step
    assert long[0].finish_reason == "cancelled" and engine.waiting == 0 and engine.running == 4
    for h in long[1:]:
        h.cancel()
    while not engine.idle():
        engine.step()
    assert queued.result()[2] == "length" and sorted(engine._free) == [0, 1, 2, 3]


def test_long_prompts_are_prefilled_in_chunks_between_decode_steps(model):
    batched, alone, tok = model
    engine = Engine(batched, tok, prefill_chunk=8)
    short = engine.submit(GenerationRequest([4, 5, 6], 20, ignore_eos=True))
    engine.step()  # prefilled: decoding from now on
    long_prompt = list(range(10, 74))
    long = engine.submit(GenerationRequest(long_prompt, 4, ignore_eos=True))
    before = short.stats.completion_tokens
    for _ in range(4):
        engine.step()
    assert short.stats.completion_tokens == before + 4  # it kept decoding while the long prompt went in
    while not engine.idle():
        engine.step()
    assert long.result()[1] == run_alone(alone, long_prompt, 4)


@pytest.mark.parametrize("request_,text", [
    (GenerationRequest([], 4), "the prompt is empty"),
    (GenerationRequest([1, 2], 0), "max_tokens must be at least 1"),
    (GenerationRequest([1] * 90, 10), "a cache row holds 96"),
    (GenerationRequest([1, 10_000], 4), "prompt token ids must be in"),
])
def test_bad_requests_are_refused_up_front(model, request_, text):
    engine = Engine(model[0], model[2])
    with pytest.raises(InputError, match=text):
        engine.submit(request_)
    assert engine.idle()


def test_waiting_limit_and_shutdown(model):
    engine = Engine(model[0], model[2], max_waiting=2)
    engine.submit(GenerationRequest([1, 2], 2))
    engine.submit(GenerationRequest([1, 2], 2))
    with pytest.raises(EngineFull):
        engine.submit(GenerationRequest([1, 2], 2))
    engine.start()
    engine.stop(timeout=10)
    assert engine.idle()
    with pytest.raises(EngineUnavailable, match="shutting down"):
        engine.submit(GenerationRequest([1, 2], 2))


def test_stop_under_load_finishes_or_cancels_everything(model):
    engine = Engine(model[0], model[2]).start()
    handles = [engine.submit(GenerationRequest([3 + i, 4], 80, ignore_eos=True)) for i in range(8)]
    engine.stop(timeout=0.01)  # too short for all of them: the rest are cancelled cleanly
    reasons = [h.result()[2] for h in handles]
    assert set(reasons) <= {"length", "cancelled"} and "cancelled" in reasons
    assert engine.idle() and sorted(engine._free) == [0, 1, 2, 3]


@pytest.mark.slow
def test_inductor_from_the_engine_thread_compiles_every_bucket(tokenized_checkpoints):
    """Dynamo's recompile limit is per thread: the engine's thread must lift it too, or the ninth
    bucket (prompt sizes x row counts) fails with FailOnRecompileLimitHit under fullgraph."""
    path = tokenized_checkpoints[CASE]
    session, _ = load_model(path, "inductor", "float32", 128, rows=8)
    engine = Engine(session, None).start()
    try:
        lengths = [1, 3, 17, 40, 70, 100, 2, 9, 33, 65, 90, 5]  # every prompt bucket, 1 to 8 rows decoding
        handles = [engine.submit(GenerationRequest(list(range(3, 3 + n)), 6, ignore_eos=True)) for n in lengths]
        results = [h.result() for h in handles]
    finally:
        engine.stop()
    assert all(reason == "length" and len(ids) == 6 for _, ids, reason in results), results


def test_a_scored_prompt_is_followed_by_its_tokens_once(model):
    """echo with max_tokens: the prompt scored, then the answer the request gets alone (the scored
    chunk is not run again as a decode step: that emitted its first token twice)."""
    batched, alone, tok = model
    engine = Engine(batched, tok)
    params = SamplingParams(logprobs=2)
    text, ids, reason = _drive(engine, GenerationRequest([5, 6, 7, 8], 5, params, ignore_eos=True, prompt_logprobs=2))
    assert ids == run_alone(alone, [5, 6, 7, 8], 5, params) and reason == "length"
