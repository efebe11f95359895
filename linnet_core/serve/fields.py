"""A request's generation fields read in one place for every face (the OpenAI HTTP API, Triton's
`sampling_parameters`): types, ranges, counts and lengths, so a bad value is a client error naming
its field, never a fault inside the engine's thread or a NaN in the logits."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

from ..errors import InputError
from ..runtime.constraints import MAX_CHOICES, MAX_SOURCE_CHARS, GrammarError, GrammarSpec, grammar_kind, grammars
from ..runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams
from .engine import GenerationRequest

MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_K = 1 << 31
CHARS_PER_POSITION = 64  # text longer than this per cache position cannot fit a row: refused before tokenizing
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes

# OpenAI fields that would change the result, which Linnet does not implement: refused by name, never
# ignored. Each maps to whether a given value asks for the feature (the neutral values pass).
UNSUPPORTED = {
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "suffix": lambda v: bool(v),
}
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


class FieldError(InputError):
    """A request field with a bad value; `param` names it (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_json(raw: bytes | str, what: str = "the body") -> Any:
    """JSON as the standard defines it (no NaN or Infinity); an integer past Python's digit limit or
    nesting past the parser's recursion limit is a client error too, not a crash."""
    def refuse_constant(name: str):
        raise FieldError(f"{what} is not valid JSON: {name} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FieldError(f"{what} is not valid JSON") from None
    except RecursionError:
        raise FieldError(f"{what} nests too deeply") from None
    except ValueError:  # an integer past Python's 4,300 digits
        raise FieldError(f"{what} holds an integer too long to read") from None


def prompt_char_limit(cache_len: int) -> int:
    return CHARS_PER_POSITION * cache_len


def refuse_unsupported(fields: dict, more: dict | None = None) -> None:
    for name, asks in {**UNSUPPORTED, **(more or {})}.items():
        if name in fields and asks(fields[name]):
            raise FieldError(f"'{name}' is not supported by this server", name)


def number(fields: dict, name: str, default: Any, low: float | None = None, high: float | None = None,
           integer: bool = False, low_open: bool = False) -> Any:
    """fields[name] (default when absent or null) checked: its type, finite, within [low, high]."""
    value = fields.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise FieldError(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(f"'{name}' must be a finite number", name)
    if low is not None and (value <= low if low_open else value < low):
        raise FieldError(f"'{name}' must be {'>' if low_open else '>='} {low}, got {_short(value)}", name)
    if high is not None and value > high:
        raise FieldError(f"'{name}' must be <= {high}, got {_short(value)}", name)
    return value


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def flag(fields: dict, name: str, default: bool = False) -> bool:
    value = fields.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise FieldError(f"'{name}' must be true or false", name)
    return value


def stop_strings(fields: dict) -> tuple[str, ...]:
    stop = fields.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)):
        raise FieldError(f"'stop' must be a string or a list of at most {MAX_STOPS} strings of at most "
                         f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(s for s in stops if s)


def stop_token_ids(fields: dict, vocab_size: int) -> tuple[int, ...]:
    ids = fields.get("stop_token_ids")
    if ids is None:
        return ()
    if (not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)):
        raise FieldError(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                         f"[0, {vocab_size})", "stop_token_ids")
    return tuple(ids)


def logit_bias(fields: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: ids as decimal strings (JSON keys) or integers, biases in [-100, 100]."""
    bias = fields.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise FieldError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else None
        if token is None or not 0 <= token < vocab_size:
            raise FieldError(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {_short(repr(key))}",
                             "logit_bias")
        out[token] = float(number({"logit_bias": value}, "logit_bias", 0.0, *BIAS_RANGE))
    return tuple(sorted(out.items()))


def logprobs_count(fields: dict) -> int | None:
    """How many top log-probabilities a token carries, or None for none: chat's `logprobs: true` with
    `top_logprobs` (0..20), or completions' `logprobs: k` (0..20)."""
    asked = fields.get("logprobs")
    top = number(fields, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if asked is None or asked is False:
        if top:
            raise FieldError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    if asked is True:
        return top or 0
    return number(fields, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)


def sampling(fields: dict, default_temperature: float, vocab_size: int) -> SamplingParams:
    seed = number(fields, "seed", None, *SEED_RANGE, integer=True)
    return SamplingParams(
        temperature=float(number(fields, "temperature", default_temperature, 0.0, 2.0)),
        top_p=float(number(fields, "top_p", 1.0, 0.0, 1.0, low_open=True)),
        top_k=int(number(fields, "top_k", 0, 0, MAX_TOP_K, integer=True)), seed=seed,
        min_p=float(number(fields, "min_p", 0.0, 0.0, 1.0)),
        presence_penalty=float(number(fields, "presence_penalty", 0.0, -2.0, 2.0)),
        frequency_penalty=float(number(fields, "frequency_penalty", 0.0, -2.0, 2.0)),
        repetition_penalty=float(number(fields, "repetition_penalty", 1.0, 0.0, 1e4, low_open=True)),
        logit_bias=logit_bias(fields, vocab_size), logprobs=logprobs_count(fields))


def _source(value: Any, param: str, what: str) -> str:
    if isinstance(value, (dict, bool)) and what == "JSON schema":
        value = json.dumps(value)  # true / false are schemas too
    if not isinstance(value, str) or not value.strip():
        raise FieldError(f"'{param}' must be {'an object' if what == 'JSON schema' else 'a string'} ({what})", param)
    if len(value) > MAX_SOURCE_CHARS:
        raise FieldError(f"'{param}' is {len(value)} characters; the limit is {MAX_SOURCE_CHARS}", param)
    return value


def grammar_spec(fields: dict) -> tuple[GrammarSpec, str] | None:
    """The structured output a request asks for, and the field that asked: OpenAI's `response_format`
    (json_object, json_schema), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
    `guided_grammar` and `structured_outputs`, llama-server's `json_schema` and `grammar`. One at most."""
    found: list[tuple[GrammarSpec, str]] = []
    fmt = fields.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append((GrammarSpec("json_object"), "response_format"))
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema", {}) if isinstance(inner, dict) else None
            if schema is None:
                raise FieldError("'response_format' json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                                 "response_format")
            found.append((GrammarSpec("json_schema", _source(schema, "response_format", "JSON schema")),
                          "response_format"))
        elif kind != "text":
            raise FieldError("'response_format' type must be text, json_object or json_schema", "response_format")
    outputs = fields.get("structured_outputs")
    if outputs is not None and not isinstance(outputs, dict):
        raise FieldError("'structured_outputs' must be an object", "structured_outputs")
    named = {f"guided_{k}": fields.get(f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
    named.update({k: fields.get(k) for k in ("json_schema", "grammar")})
    for key, value in (outputs or {}).items():
        named[f"structured_outputs.{key}"] = value
    for param, value in named.items():
        if value is None or value is False:
            continue
        key = param.rsplit(".", 1)[-1].removeprefix("guided_")
        if key in ("json", "json_schema"):
            found.append((GrammarSpec("json_schema", _source(value, param, "JSON schema")), param))
        elif key == "json_object":
            found.append((GrammarSpec("json_object"), param))
        elif key == "regex":
            found.append((GrammarSpec("regex", _source(value, param, "a regular expression")), param))
        elif key == "choice":
            if (not isinstance(value, list) or not 0 < len(value) <= MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in value)):
                raise FieldError(f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings", param)
            found.append((GrammarSpec("choice", json.dumps(value)), param))
        elif key == "grammar":
            source = _source(value, param, "a GBNF or Lark grammar")
            found.append((GrammarSpec(grammar_kind(source), source), param))
        else:
            raise FieldError(f"'{param}' is not a structured output kind (json, regex, choice, grammar, json_object)", param)
    if len(found) > 1:
        raise FieldError(f"'{found[1][1]}' asks for a second output format beside '{found[0][1]}'", found[1][1])
    return found[0] if found else None


def grammar_compiler(tokenizer, engine):
    """How a face compiles requests' structured output for the engine's model (the first one builds the
    vocabulary's tables: about a second at 150k tokens); None without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda spec: grammars(tokenizer, engine.session.vocab_size, engine.eos_ids).compile(spec)


def choice_counts(fields: dict, most: int) -> tuple[int, int]:
    """(n, best_of): the choices returned and those generated to choose them from (the `most` rows
    a server has bound both: each choice is a row)."""
    n = number(fields, "n", 1, 1, most, integer=True)
    best_of = number(fields, "best_of", n, 1, most, integer=True)
    if best_of < n:
        raise FieldError(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    return n, best_of


# What a face that answers one text per request (Triton's generate) cannot return: refused there by name.
TEXT_ONLY_UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False, 0),
    "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: bool(v),
}


def generation_request(fields: dict, prompt: list[int], *, default_max_tokens: int, max_tokens_limit: int,
                       vocab_size: int, default_temperature: float = 1.0, text_only: bool = False,
                       compile_grammar=None, tool_grammar: GrammarSpec | None = None) -> GenerationRequest:
    """A GenerationRequest from a face's fields: OpenAI's names (`max_tokens` or
    `max_completion_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, the penalties,
    `logit_bias`, `logprobs`/`top_logprobs`, `echo`, `stop`, `stop_token_ids`, `ignore_eos`, vLLM's
    `skip_special_tokens`; Linnet's `draft_tokens`, speculative decoding's cap for this request), every
    one checked; unsupported features refused by name (with `text_only`, also what needs more than
    one text back: choices, log-probabilities). A structured output (`grammar_spec`) is compiled by
    `compile_grammar` (None: the model has no tokenizer to compile it for), as is `tool_grammar`, the
    calls a `required` or named `tool_choice` holds the answer to."""
    if not isinstance(fields, dict):
        raise FieldError("the sampling parameters must be a JSON object")
    refuse_unsupported(fields, TEXT_ONLY_UNSUPPORTED if text_only else None)
    echo = flag(fields, "echo")  # the prompt scored (and returned): then no new token is needed
    least = 0 if echo else 1
    max_tokens = number(fields, "max_tokens", default_max_tokens, least, max_tokens_limit, integer=True)
    if fields.get("max_completion_tokens") is not None:
        max_tokens = number(fields, "max_completion_tokens", max_tokens, least, max_tokens_limit, integer=True)
    params = sampling(fields, default_temperature, vocab_size)
    asked = grammar_spec(fields)
    if tool_grammar is not None:
        if asked is not None:
            raise FieldError(f"'{asked[1]}' cannot hold an answer that 'tool_choice' holds to a tool call", asked[1])
        asked = (tool_grammar, "tool_choice")
    if asked is not None:
        spec, param = asked
        if compile_grammar is None:
            raise FieldError(f"'{param}': structured output needs the model's tokenizer, which this server lacks", param)
        try:
            params = replace(params, grammar=compile_grammar(spec))
        except GrammarError as e:
            raise FieldError(f"'{param}': {e.message}", param) from None
    return GenerationRequest(prompt, max_tokens, params, stop_strings(fields), stop_token_ids(fields, vocab_size),
                             flag(fields, "ignore_eos"), prompt_logprobs=(params.logprobs or 0) if echo else None,
                             skip_special_tokens=flag(fields, "skip_special_tokens", True),
                             draft_tokens=number(fields, "draft_tokens", None, 0, 16, integer=True))
