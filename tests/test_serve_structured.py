"""Structured output on `linnet serve`: JSON schema (OpenAI's response_format, the SDK's `parse`),
JSON objects, regular expressions, choices and grammars, constrained and free rows in one batched
step. The fixtures' weights are random: whatever they prefer, the grammar's mask keeps the output
valid, so every answer that finishes parses and validates."""

from __future__ import annotations

import json
import re
import threading
from enum import Enum
from typing import Literal, Optional, Union

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
pydantic = pytest.importorskip("pydantic")

from linnet_core.compile import load_model  # noqa: E402
from linnet_core.runtime.constraints import GrammarSpec, grammars  # noqa: E402
from linnet_core.runtime.generate import Generation  # noqa: E402
from linnet_core.runtime.sampling import Sampler, SamplingParams  # noqa: E402
from server_fixtures import served_checkpoint  # noqa: E402

CASE = "qwen2-bias-tied"
CACHE = 256


class Color(str, Enum):
    red = "red"
    green = "green"


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=12)
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    """Nested objects, arrays, enums, anyOf and bounded numbers, as agents' schemas have them."""

    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=150)
    score: float = pydantic.Field(ge=-1, le=1)
    color: Color
    tags: list[Literal["a", "bb", "ccc"]] = pydantic.Field(max_length=3)
    address: Address
    nickname: Optional[str] = pydantic.Field(max_length=6)
    pet: Union[int, bool]

    model_config = pydantic.ConfigDict(extra="forbid")


@pytest.fixture(scope="module")
def served(tokenized_checkpoints):
    with served_checkpoint(tokenized_checkpoints[CASE], CACHE, prefill_chunk=64) as (url, engine, alone, tok):
        yield url, alone, tok, engine


def chat(url, **body):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Describe someone."}],
                                                       "max_tokens": 200, "temperature": 0, **body}, timeout=120)
    return r.status_code, r.json()


def schema_format(model) -> dict:
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema(),
                                                   "strict": True}}


def test_a_json_schema_answer_validates(served):
    url, *_ = served
    status, body = chat(url, response_format=schema_format(Person))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    Person.model_validate_json(choice["message"]["content"])


def test_sampled_answers_validate_too(served):
    url, *_ = served
    for seed in range(3):
        status, body = chat(url, response_format=schema_format(Person), temperature=1.0, seed=seed)
        assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
        Person.model_validate_json(body["choices"][0]["message"]["content"])


@pytest.mark.parametrize("fields, check", [
    ({"guided_regex": r"[A-Z][a-z]{2,5} (is|was) [0-9]{1,3}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} (is|was) [0-9]{1,3}", t)),
    ({"guided_choice": ["positive", "negative", "neutral"]}, lambda t: t in ("positive", "negative", "neutral")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"grammar": 'root ::= answer " " num\nanswer ::= "yes" | "no"\nnum ::= [1-9] [0-9]?'},  # GBNF (llama-server)
     lambda t: re.fullmatch(r"(yes|no) [1-9][0-9]?", t)),
    ({"guided_grammar": 'start: WORD ("," WORD)~0..2\nWORD: /[a-z]{1,4}/'},  # Lark
     lambda t: re.fullmatch(r"[a-z]{1,4}(,[a-z]{1,4}){0,2}", t)),
    ({"json_schema": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}},
     lambda t: all(0 <= v <= 9 for v in json.loads(t)) and len(json.loads(t)) <= 4),
])
def test_every_kind_of_constraint_holds(served, fields, check):
    url, *_ = served
    status, body = chat(url, **fields)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["message"]["content"]), choice


def test_any_json_object(served):
    """Keys and strings are unbounded here, which random weights never close on their own: a bias
    toward the quote and the brace (the grammar still decides where each may go) ends the object."""
    url, alone, tok, _ = served
    bias = {str(tok.encode(c, add_special_tokens=False)[0]): 8 for c in ('"', "}")}
    status, body = chat(url, response_format={"type": "json_object"}, logit_bias=bias)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_constrained_and_free_rows_side_by_side_get_what_they_get_alone(served):
    url, alone, tok, engine = served
    jobs = [dict(response_format=schema_format(Person)), dict(), dict(guided_choice=["alpha", "beta"]),
            dict(response_format={"type": "json_object"}, temperature=0.7, seed=3, max_tokens=40), dict(max_tokens=30)]
    results = [None] * len(jobs)

    def one(i):
        results[i] = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 120,
                                                               "temperature": 0, "ignore_eos": False, **jobs[i]},
                                timeout=120).json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    book = grammars(tok, alone.vocab_size, engine.eos_ids)
    specs = [GrammarSpec("json_schema", json.dumps(Person.model_json_schema())), None,
             GrammarSpec("choice", json.dumps(["alpha", "beta"])), GrammarSpec("json_object"), None]
    prompt = tok.encode("Once upon a time")
    for job, spec, body in zip(jobs, specs, results, strict=True):
        params = SamplingParams(temperature=job.get("temperature", 0), seed=job.get("seed"),
                                grammar=book.compile(spec) if spec else None)
        ids = list(Generation(alone, prompt, job.get("max_tokens", 120), Sampler(params, prompt), stop_ids=engine.eos_ids))
        assert body["choices"][0]["text"] == tok.decode(ids), job


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"grammar": "root ::= (\"a\""}, "grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"guided_json": "x" * 70000}, "guided_json"),
])
def test_a_schema_that_cannot_compile_is_a_400_naming_the_field(served, fields, param):
    url, *_ = served
    status, body = chat(url, max_tokens=4, **fields)
    assert status == 400 and body["error"]["param"] == param, body


def test_the_openai_sdk_parses_into_the_pydantic_model(served):
    openai = pytest.importorskip("openai")
    url, *_ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Describe someone."}],
                                      response_format=Person, max_tokens=200, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Person)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True,
                                            response_format=schema_format(Person), max_tokens=200, temperature=0)
    Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in stream if c.choices))


@pytest.mark.parametrize("backend", ["onnxruntime", "jax"])
def test_the_mask_holds_on_every_backend(served, backend):
    """The grammar lives in the sampler, over whatever logits a backend's step returns."""
    pytest.importorskip({"onnxruntime": "onnxruntime", "jax": "jax"}[backend])
    url, alone, tok, engine = served
    session, _ = load_model(tok.folder, backend, "float32", CACHE, rows=1)
    book = grammars(tok, session.vocab_size, engine.eos_ids)
    params = SamplingParams(grammar=book.compile(GrammarSpec("json_schema", json.dumps(Person.model_json_schema()))))
    prompt = tok.encode("Describe someone.")
    ids = list(Generation(session, prompt, 200, Sampler(params, prompt), stop_ids=engine.eos_ids))
    Person.model_validate_json(tok.decode(ids))
