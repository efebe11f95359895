"""Speculative decoding: greedy output is the plain run's on every backend, family and dtype (with a
draft that agrees, one that never does, and prompt lookup); sampled output follows the target's
distribution (a chi-square test of the acceptance rule); rejected positions are never read; bad
options give one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from linnet_core.compile import load_model
from linnet_core.errors import InputError
from linnet_core.runtime.drafts import Draft, judge
from linnet_core.runtime.generate import Generation
from linnet_core.runtime.sampling import Sampler, SamplingParams
from linnet_core.runtime.session import Chunk
from linnet_core.runtime.speculative import DraftLength, DraftModel, PromptLookup, Speculation

from family_fixtures import CPU_BACKENDS, FAMILY_CASES, HAVE, needs_kernels
from test_cli import assert_one_line_error, invoke

CACHE = 48
NEW = 14
# repeats itself, so prompt lookup finds spans to propose; the random fixtures loop soon too
PROMPT = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]


class Contrary:
    """A proposer that never agrees with the target: the agreeing draft's tokens, each moved by one."""

    def __init__(self, draft: DraftModel, vocab: int):
        self.draft, self.vocab = draft, vocab

    def propose(self, rows):
        return [None if d is None else Draft(tuple((t + 1) % self.vocab for t in d.tokens))
                for d in self.draft.propose(rows)]


# Every family on the generated PyTorch; the other backends on the sliding-window family, in the
# dtypes each runs on a CPU (ONNX Runtime and XLA have no CPU bfloat16 here).
DTYPES = {"torch": ["float32", "bfloat16", "q4_0"], "inductor": ["float32", "bfloat16", "q4_0"],
          "onnxruntime": ["float32", "q4_0"], "jax": ["float32", "q4_0"], "stablehlo": ["float32", "q4_0"]}
CASES = [("torch", case, dtype) for case in FAMILY_CASES for dtype in DTYPES["torch"]] + \
    [(b, "mistral-window", dtype) for b in CPU_BACKENDS if b != "torch" for dtype in DTYPES[b]]


def _marks(backend, dtype):
    marks = [pytest.mark.slow] if backend == "inductor" else []
    return marks + ([needs_kernels] if dtype in ("bfloat16", "q4_0") and backend in ("torch", "inductor") else [])


@pytest.mark.parametrize("backend,case,dtype", [pytest.param(*c, marks=_marks(c[0], c[2])) for c in CASES])
def test_greedy_speculation_is_the_plain_run(backend, case, dtype, checkpoints):
    target, _ = load_model(checkpoints[case], backend, dtype, CACHE)
    drafting, _ = load_model(checkpoints[case], backend, dtype, CACHE)
    plain = list(Generation(target, PROMPT, NEW))
    agreeing = DraftModel(drafting)
    for proposer in (agreeing, Contrary(agreeing, target.vocab_size), PromptLookup(1, 3)):
        for k in (1, 3, 8):
            gen = Generation(target, PROMPT, NEW, speculation=Speculation(proposer, k, adaptive=False))
            assert list(gen) == plain, (type(proposer).__name__, k)
            st = gen.speculative
            if proposer is agreeing:  # the same model proposes: all but the numerics of a chunk agree
                assert st.steps and st.tokens_per_step > 1.5, st
            elif isinstance(proposer, Contrary):
                assert st.steps and st.accepted == 0 and st.tokens_per_step == 1.0, st


@pytest.fixture(scope="module")
def float_target(checkpoints):
    return load_model(checkpoints["qwen3-headdim128"], "torch", "float32", CACHE)[0]


def test_rejected_positions_are_never_read(float_target, checkpoints):
    """After every check, the cache positions past the accepted prefix are poisoned with NaN: a read
    of any of them would turn the next logits to NaN and the tokens to nonsense."""
    s = float_target
    plain = list(Generation(s, PROMPT, NEW))
    real = s.step_tokens
    poisoned = []

    def poisoning(chunks):
        out = real(chunks)
        for c, tokens in zip(chunks, out, strict=True):
            if c.draft is not None and len(tokens) <= len(c.draft.tokens):  # something was rejected
                first_stale = c.start + len(tokens)
                for cache in (s.k_cache, s.v_cache):  # [L, rows, KV, S, D]
                    cache[:, c.slot, :, first_stale:c.start + len(c.ids)] = float("nan")
                poisoned.append(c.start + len(c.ids) - first_stale)
        return out

    s.step_tokens = poisoning
    try:
        drafting, _ = load_model(checkpoints["qwen3-headdim128"], "torch", "float32", CACHE)
        spec = Speculation(Contrary(DraftModel(drafting), s.vocab_size), 4, adaptive=False)
        assert list(Generation(s, PROMPT, NEW, speculation=spec)) == plain
    finally:
        del s.step_tokens
    assert len(poisoned) >= NEW - 4 and sum(poisoned) >= 3 * (NEW - 4)  # most steps rejected, most positions poisoned


def _draws(sampler_params: SamplingParams, logits: torch.Tensor, q: torch.Tensor | None, k: int, n: int, seed: int):
    """n runs of 2 tokens through the acceptance rule alone, the target's logits at position j being
    logits[j] whatever came before (so the pair's law is p0 x p1), drafts drawn from q[j] (or always
    token 1 when q is None: a certain proposal, as prompt lookup's)."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(n):
        sampler = Sampler(SamplingParams(**{**sampler_params.__dict__, "seed": seed * 100_003 + i}))
        tokens: list[int] = []
        while len(tokens) < 2:
            j = len(tokens)
            rows = range(j, j + k)
            proposed = [1] * k if q is None else [int(torch.multinomial(q[r], 1, generator=g)) for r in rows]
            draft = Draft(tuple(proposed), None if q is None else q[j:j + k])
            tokens += judge(sampler, draft, [0] * (k + 1), logits[j:j + k + 1])
        pairs.append(tokens[0] * logits.shape[1] + tokens[1])
    return np.bincount(pairs, minlength=logits.shape[1] ** 2)


def _target_probs(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """The distribution the plain sampler draws from at each row (temperature, then top-k)."""
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.softmax(-1)


@pytest.mark.parametrize("proposal", ["draft", "certain"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)],
                         ids=["t1", "t0.7-top3"])
def test_sampled_speculation_follows_the_target_distribution(proposal, params):
    V, k, n = 5, 3, 4000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, V, generator=g) * 1.5
    q = (torch.randn(6, V, generator=g) * 1.5).softmax(-1) if proposal == "draft" else None
    counts = _draws(params, logits, q, k, n, seed=1)
    p = _target_probs(params, logits).double().numpy()
    law = np.outer(p[0], p[1]).reshape(-1)
    seen = law > 0
    assert counts[~seen].sum() == 0  # nothing the target cannot draw
    stat = chisquare(counts[seen], law[seen] / law[seen].sum() * counts.sum())
    assert stat.pvalue > 1e-3, (stat, counts, expected)


def test_seeded_speculative_sampling_repeats(float_target, checkpoints):
    drafting, _ = load_model(checkpoints["qwen3-headdim128"], "torch", "float32", CACHE)
    spec = Speculation(DraftModel(drafting), 4)

    def sample(seed):
        sampler = Sampler(SamplingParams(temperature=1.3, top_p=0.95, seed=seed))
        return list(Generation(float_target, PROMPT, NEW, sampler, speculation=spec))

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_a_draft_chunk_is_the_last_token_then_the_draft(float_target):
    with pytest.raises(InputError, match="draft's chunk"):
        float_target.step_tokens([Chunk([1, 2, 3], 0, 0, None, Draft((3,)))])


def test_the_draft_length_adapts_to_the_acceptance_rate():
    length = DraftLength(8, draft_cost=0.1)
    for _ in range(10):
        length.observe(8, 8)
    assert length.next() == 8
    for _ in range(10):
        length.observe(4, 0)
    assert length.next() == 1
    assert DraftLength(8, 0.1, adaptive=False).next() == 8


def test_speculation_cuts_a_draft_at_a_token_past_the_target_vocabulary():
    class Wide:
        def propose(self, rows):
            return [Draft((3, 4, 200, 5))]

    assert Speculation(Wide(), 4).propose([(0, [1, 2], 4, None)], 160)[0].tokens == (3, 4)


def test_run_speculates_from_the_command_line(tokenized_checkpoints):
    model = tokenized_checkpoints["qwen3-headdim128"]
    args = ["run", model, "-p", "one two three one two three one two", "-n", "12", "--json", "--cache-len", "64"]
    plain = json.loads(invoke(*args).stdout)
    for extra in (["--speculate", "ngram"], ["--draft", model, "--draft-tokens", "3"]):
        r = invoke(*args, *extra)
        assert r.exit_code == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["tokens"] == plain["tokens"]
        assert got["speculative"]["proposer"] == ("ngram" if extra[0] == "--speculate" else "draft")
        assert got["speculative"]["verify_steps"] >= 1 or extra[0] == "--speculate"


def test_bad_speculation_options_give_one_line(tokenized_checkpoints):
    model = tokenized_checkpoints["qwen3-headdim128"]
    base = ["run", model, "-p", "one two", "-n", "2"]
    assert_one_line_error(invoke(*base, "--speculate", "eagle"), contains="--speculate takes ngram or draft")
    assert_one_line_error(invoke(*base, "--speculate", "ngram", "--draft", model), contains="drop --draft")
    assert_one_line_error(invoke(*base, "--speculate", "draft"), contains="needs --draft")
    other = tokenized_checkpoints["llama-gqa-untied"]  # another tokenizer (spm, not Qwen's byte-level BPE)
    assert_one_line_error(invoke(*base, "--draft", other), contains="has another tokenizer")
    assert_one_line_error(invoke(*base, "--draft", model, "--draft-backend", "tensorrt"), contains="TensorRT")


@pytest.mark.skipif(not HAVE["onnxruntime"], reason="onnxruntime is not installed")
def test_a_draft_on_another_backend_and_dtype(checkpoints):
    """A draft on any backend and dtype (here ONNX Runtime in q4_0 for a float32 PyTorch target)."""
    target, _ = load_model(checkpoints["llama-gqa-untied"], "torch", "float32", CACHE)
    drafting, _ = load_model(checkpoints["llama-gqa-untied"], "onnxruntime", "q4_0", CACHE)
    plain = list(Generation(target, PROMPT, NEW))
    gen = Generation(target, PROMPT, NEW, speculation=Speculation(DraftModel(drafting), 4))
    assert list(gen) == plain and gen.speculative.accepted > 0


@pytest.mark.parametrize("backend", ["torch"] + ["onnxruntime"] * HAVE["onnxruntime"])
def test_speculative_rows_beside_plain_rows_get_what_they_get_alone(backend, tokenized_checkpoints):
    """The engine's batched-equals-alone, with speculative rows (a draft model, and prompt lookup)
    beside plain ones (draft_tokens 0): greedy rows as the plain run, sampled and penalised rows as the
    same request speculating alone; drafts checked and counted in the metrics."""
    from linnet_core.serve.engine import Engine, GenerationRequest
    from test_engine import requests

    path = tokenized_checkpoints["qwen2-bias-tied"]
    batched, _ = load_model(path, backend, "float32", 96, rows=4)
    drafting, _ = load_model(path, backend, "float32", 96, rows=4)
    alone, _ = load_model(path, backend, "float32", 96, rows=1)
    drafting_alone, _ = load_model(path, backend, "float32", 96, rows=1)
    for proposer, proposer_alone in ((DraftModel(drafting), DraftModel(drafting_alone)), (PromptLookup(1), PromptLookup(1))):
        spec = Speculation(proposer, 3)
        reqs = [GenerationRequest(r.prompt, r.max_tokens, r.sampling, ignore_eos=True, draft_tokens=[None, 0, 2][i % 3])
                for i, r in enumerate(requests(12, seed=5))]
        engine = Engine(batched, None, prefill_chunk=16, speculation=spec).start()
        try:
            results = [h.result() for h in [engine.submit(r) for r in reqs]]
        finally:
            engine.stop()
        for req, (_, ids, reason) in zip(reqs, results, strict=True):
            assert reason == "length" and len(ids) == req.max_tokens
            own = None if req.draft_tokens == 0 else Speculation(proposer_alone, min(3, req.draft_tokens or 3))
            want = list(Generation(alone, req.prompt, req.max_tokens, Sampler(req.sampling, req.prompt),
                                   speculation=own))
            assert ids == want, req
            if req.sampling.greedy and not req.sampling.shapes_scores:
                assert ids == list(Generation(alone, req.prompt, req.max_tokens)), "greedy: the plain run"
        m = engine.metrics
        assert m.draft_checks > 0 and 0 <= m.draft_accepted <= m.draft_proposed


def test_a_speculating_server_answers_the_openai_client(tokenized_checkpoints):
    """`linnet serve --speculate ngram` as the openai SDK calls it: the greedy answer is the plain
    run's, `draft_tokens` (extra_body) caps or turns off one request's drafts, and /metrics counts them."""
    import httpx
    import openai

    from linnet_core.serve.config import ServeConfig
    from linnet_core.serve.http import Limits, Server, create_app
    from linnet_core.serve.launch import launch
    from server_fixtures import app_in_thread

    path = tokenized_checkpoints["qwen3-headdim128"]
    served = launch(ServeConfig(str(path), cache_len=96, rows=2, speculate="ngram", draft_tokens=4))
    alone, _ = load_model(path, "torch", "float32", 96)
    prompt = "one two three four one two three four one two"
    want = served.tokenizer.decode(list(Generation(alone, served.tokenizer.encode(prompt), 24)))
    served.engine.start()
    try:
        with app_in_thread(create_app(Server(served.engine, served.tokenizer, "tiny", Limits(max_tokens=96)))) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none")
            for extra in ({}, {"draft_tokens": 2}, {"draft_tokens": 0}):
                r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True, **extra})
                assert r.choices[0].text == want, extra
            with pytest.raises(openai.BadRequestError, match="draft_tokens"):
                client.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={"draft_tokens": 99})
            metrics = httpx.get(url + "/metrics").text
    finally:
        served.engine.stop()
    checks = int(next(l.split()[-1] for l in metrics.splitlines() if l.startswith("linnet_spec_decode_checks_total")))
    assert checks > 0 and "linnet_spec_decode_accepted_tokens_total" in metrics


def test_a_failing_proposer_costs_its_drafts_not_the_server(float_target):
    """The engine decodes plainly through a step whose drafts could not be made."""
    from linnet_core.serve.engine import Engine, GenerationRequest

    class Broken:
        def propose(self, rows):
            raise RuntimeError("draft session lost")

    engine = Engine(float_target, None, speculation=Speculation(Broken(), 4))
    h = engine.submit(GenerationRequest(PROMPT, 6, ignore_eos=True))
    while not engine.idle():
        engine.step()
    assert h.result()[1] == list(Generation(float_target, PROMPT, 6)) and engine.healthy
