"""The OpenAI API's sampling fields on `linnet serve`: logprobs, n and best_of, penalties, logit_bias,
min_p, stream_options — against a direct computation from the model's own logits, through the
official `openai` SDK as well as raw HTTP."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from linnet_core.runtime.generate import Generation  # noqa: E402
from linnet_core.runtime.sampling import Sampler, SamplingParams  # noqa: E402
from linnet_core.tokenizer import Tokenizer  # noqa: E402
from server_fixtures import served_checkpoint  # noqa: E402

CASE = "qwen2-bias-tied"
CACHE = 128
ROWS = 4


@pytest.fixture(scope="module")
def served(tokenized_checkpoints):
    path = tokenized_checkpoints[CASE]
    with served_checkpoint(path, CACHE, rows=ROWS) as (url, _, alone, tok):
        yield url, alone, tok, path


def post(url, route, **body):
    r = httpx.post(url + (route if route.startswith("/") else f"/v1/{route}"), json=body, timeout=60)
    return r.status_code, r.json()


def teacher_forced_logprobs(alone, ids: list[int]) -> np.ndarray:
    """log_softmax of the model's float32 logits at every position of `ids` [T, V] (no sampling)."""
    out = alone.prefill(ids, logits="all").logits[0]
    return torch.from_numpy(out).log_softmax(-1).numpy()


# -- the sampler itself -----------------------------------------------------------------------
def test_penalties_and_bias_are_vllms_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    prompt, chosen = [3, 4, 4], [7, 7, 9]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.7,
                            logit_bias=((11, 4.0), (3, -2.0)))
    s = Sampler(params, prompt)
    s._chosen, s._counts = list(chosen), __import__("collections").Counter(chosen)
    want = logits.clone()
    want[11] += 4.0
    want[3] -= 2.0
    for t in {3, 4, 7, 9}:  # prompt and output tokens: transformers' CTRL rule
        want[t] = want[t] / 1.7 if want[t] > 0 else want[t] * 1.7
    for t, n in ((7, 2), (9, 1)):  # output tokens only: frequency x count + presence
        want[t] -= 0.3 * n + 0.5
    torch.testing.assert_close(s._shaped(logits), want)


def test_logprobs_are_the_sharpened_distributions_and_min_p_cuts():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, generator=g) * 2
    greedy = Sampler(SamplingParams(logprobs=5))
    token = greedy.pick(logits)
    lp = greedy.take_logprobs()
    ref = logits.log_softmax(-1)
    assert token == int(logits.argmax()) and lp.token == token
    assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-6)
    assert [t for t, _ in lp.top] == torch.topk(ref, 5).indices.tolist()
    assert greedy.take_logprobs() is None  # taken once
    hot = Sampler(SamplingParams(temperature=0.5, seed=3, logprobs=2))
    token = hot.pick(logits)
    assert hot.take_logprobs().logprob == pytest.approx(float((logits / 0.5).log_softmax(-1)[token]), abs=1e-5)
    probs = logits.softmax(-1)
    keep = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    cut = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=5))
    assert {cut.pick(logits) for _ in range(200)} <= keep


def test_a_rewound_sampler_chooses_the_same_again():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2))
    s = Sampler(SamplingParams(temperature=1.0, seed=9, frequency_penalty=1.0))
    s.pick(logits)
    state = s.snapshot()
    first = [s.pick(logits) for _ in range(5)]
    s.restore(state)
    assert [s.pick(logits) for _ in range(5)] == first


# -- over HTTP --------------------------------------------------------------------------------
def test_chat_logprobs_equal_the_models_own(served):
    url, alone, tok, path = served
    messages = [{"role": "user", "content": "The list object"}]
    status, body = post(url, "chat/completions", messages=messages, max_tokens=8, temperature=0, ignore_eos=True,
                        logprobs=True, top_logprobs=5)
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    prompt = tok.apply_chat_template(messages)
    ids = list(Generation(alone, prompt, 8))
    ref = teacher_forced_logprobs(alone, prompt + ids)
    assert len(content) == 8
    # the reference itself: transformers' float32 logits over the same tokens
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor([prompt + ids])).logits[0].log_softmax(-1).numpy()
    got = [e["logprob"] for e in content]
    np.testing.assert_allclose(got, [float(hf[len(prompt) - 1 + k][t]) for k, t in enumerate(ids)], atol=1e-4)
    for k, (entry, token) in enumerate(zip(content, ids, strict=True)):
        row = ref[len(prompt) - 1 + k]
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        tops = entry["top_logprobs"]
        assert len(tops) == 5 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert tops[0]["bytes"] == entry["bytes"]  # greedy: the chosen token is the likeliest
        assert math.isclose(sum(math.exp(t["logprob"]) for t in tops), float(np.exp(np.sort(row)[-5:]).sum()),
                            rel_tol=1e-3)
        assert bytes(entry["bytes"]) == tok.token_bytes(token)
    assert tok.decode(ids) == body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("case", ["qwen2-bias-tied", "llama-gqa-untied"])  # byte-level BPE; SentencePiece
def test_token_bytes_spell_the_text(tokenized_checkpoints, case):
    tok = Tokenizer(tokenized_checkpoints[case])
    text = "Héllo wörld, 你好 — ok"
    ids = tok.encode(text, add_special_tokens=False)
    spelled = b"".join(tok.token_bytes(t) for t in ids).decode()
    assert spelled.lstrip(" ") == text  # SentencePiece's first piece carries the space it adds


def test_completion_logprobs_have_the_legacy_shape_streamed_or_not(served):
    url, alone, tok, _ = served
    req = dict(prompt="Hello there", max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    status, body = post(url, "completions", **req)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and len(lp["tokens"]) == 6
    # keyed by text: two pieces of one UTF-8 character both read U+FFFD and share a key, as in vLLM
    assert all(1 <= len(t) <= 3 and max(t.values()) == pytest.approx(v)
               for t, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True))
    ids = list(Generation(alone, tok.encode("Hello there"), 6))
    assert lp["tokens"] == [tok.token_bytes(t).decode(errors="replace") for t in ids]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(6)]
    with httpx.stream("POST", f"{url}/v1/completions", json={**req, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [v for e in events if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)


def test_tokens_named_by_id_as_vllm_does(served):
    url, alone, tok, _ = served
    ids = list(Generation(alone, tok.encode("Hello there"), 4))
    status, body = post(url, "completions", prompt="Hello there", max_tokens=4, temperature=0, ignore_eos=True,
                        logprobs=2, return_tokens_as_token_ids=True)
    assert status == 200 and body["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    status, body = post(url, "chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                        temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    content = body["choices"][0]["logprobs"]["content"]
    assert status == 200 and all(e["token"].startswith("token_id:") for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])


def test_n_choices_are_seeded_streams_and_best_of_keeps_the_likeliest(served):
    url, alone, tok, _ = served
    req = dict(prompt="Once upon", max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    status, three = post(url, "completions", n=3, logprobs=0, **req)
    assert status == 200, three
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert three["usage"]["completion_tokens"] == 18
    again = post(url, "completions", n=3, logprobs=0, **req)[1]["choices"]  # reproducible (the prompt now cached)
    assert [c["text"] for c in again] == [c["text"] for c in three["choices"]]
    for a, b in zip(again, three["choices"], strict=True):
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-5)
    assert len({c["text"] for c in three["choices"]}) > 1  # each its own stream
    status, best = post(url, "completions", n=1, best_of=3, **req)
    assert status == 200 and len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None
    totals = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in three["choices"]}
    assert best["choices"][0]["text"] == max(totals, key=totals.get)
    assert best["usage"]["completion_tokens"] == 18  # every candidate is generated
    status, chat = post(url, "chat/completions", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4,
                        temperature=0.9, seed=1)
    assert status == 200 and [c["index"] for c in chat["choices"]] == [0, 1]


def test_logit_bias_and_penalties_per_row_in_a_batched_step(served):
    """Rows with bias, penalties, logprobs and none at all, at once: each gets what it gets alone."""
    url, alone, tok, _ = served
    prompt = tok.encode("The list object supports")
    forced = tok.encode(" x")[-1]
    jobs = [dict(logit_bias={str(forced): 100}),
            dict(frequency_penalty=1.5, presence_penalty=0.5),
            dict(repetition_penalty=1.8, logprobs=2),
            dict(temperature=0.8, seed=5, min_p=0.1, frequency_penalty=0.7),
            dict()]
    results = [None] * len(jobs)

    def one(i):
        results[i] = post(url, "completions", prompt=prompt, max_tokens=10, ignore_eos=True,
                          **{"temperature": 0, **jobs[i]})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job, (status, body) in zip(jobs, results, strict=True):
        assert status == 200, body
        bias = tuple((int(k), float(v)) for k, v in job.get("logit_bias", {}).items())
        params = SamplingParams(temperature=job.get("temperature", 0), seed=job.get("seed"), min_p=job.get("min_p", 0),
                                presence_penalty=job.get("presence_penalty", 0),
                                frequency_penalty=job.get("frequency_penalty", 0),
                                repetition_penalty=job.get("repetition_penalty", 1), logit_bias=bias)
        ids = list(Generation(alone, prompt, 10, Sampler(params, prompt)))
        assert body["choices"][0]["text"] == tok.decode(ids), job
    assert tok.encode(results[0][1]["choices"][0]["text"], add_special_tokens=False).count(forced) >= 1
    free = results[4][1]["choices"][0]["text"]
    assert results[1][1]["choices"][0]["text"] != free  # the penalties changed the greedy answer


@pytest.mark.parametrize("body, param", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(n=ROWS + 1), "n"),
    (dict(n=3, best_of=2), "best_of"),
    (dict(best_of=2, stream=True), "best_of"),
    (dict(logit_bias={"-1": 3}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(stream=True, stream_options={"include_usage": "yes"}), "stream_options"),
    (dict(return_tokens_as_token_ids="yes"), "return_tokens_as_token_ids"),
])
def test_bad_sampling_fields_are_one_400_naming_the_field(served, body, param):
    url, *_ = served
    status, out = post(url, "chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, **body)
    assert status == 400 and out["error"]["param"] == param, out


def test_the_openai_sdk_reads_logprobs_and_choices(served):
    openai = pytest.importorskip("openai")
    url, *_ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3, n=2, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    *chunks, last = list(stream)
    assert last.usage.completion_tokens == 4 and last.choices == []
    whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_tokenize_and_detokenize_as_vllm_and_llama_server_answer(served):
    url, alone, tok, _ = served
    status, out = post(url, "/tokenize", prompt="The list object")
    assert status == 200 and out["tokens"] == tok.encode("The list object") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == CACHE
    assert post(url, "/tokenize", content="The list object", add_special=False)[1]["tokens"] == \
        tok.encode("The list object", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}]
    assert post(url, "/tokenize", messages=messages)[1]["tokens"] == tok.apply_chat_template(messages)
    status, back = post(url, "/detokenize", tokens=out["tokens"])
    assert status == 200 and back["prompt"] == back["content"] == tok.decode(out["tokens"])
    assert post(url, "/detokenize", tokens=[10 ** 9])[0] == 400
    assert post(url, "/tokenize", prompt=5)[0] == 400


@pytest.mark.parametrize("length", [5, 50])  # 50: three prompt chunks of 32 scored in turn
def test_echo_scores_the_prompt_as_lm_eval_asks(served, length):
    """lm-eval's `local-completions` log-likelihood request: echo, logprobs 1, max_tokens 0, token ids."""
    url, alone, tok, _ = served
    prompt = [(7 * i + 11) % 380 + 3 for i in range(length)]
    status, body = post(url, "completions", prompt=[prompt, prompt[:-1]], echo=True, logprobs=1, max_tokens=0,
                        temperature=0)
    assert status == 200, body
    ref = teacher_forced_logprobs(alone, prompt)
    for choice, ids in zip(body["choices"], (prompt, prompt[:-1]), strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [float(ref[j - 1][ids[j]]) for j in range(1, len(ids))]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0
    # echo with new tokens, streamed: the prompt first, then the answer
    req = dict(prompt=tok.decode(prompt), echo=True, max_tokens=3, temperature=0, ignore_eos=True)
    whole = post(url, "completions", **req)[1]["choices"][0]["text"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**req, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == tok.decode(prompt)
    assert "".join(e["choices"][0]["text"] for e in events) == whole
    assert whole.startswith(tok.decode(prompt)) and len(whole) > len(tok.decode(prompt))
