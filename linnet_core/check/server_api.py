"""A running OpenAI-compatible server as `verify --url` talks to it: JSON over HTTP with a timeout
and an API key, each failure one line, and the shapes servers give logprobs in read into one.

Written against each server's documented fields: the OpenAI API's two logprob shapes (chat's
`content` entries, completions' `tokens`/`token_logprobs`/`top_logprobs`), llama-server's entries
with token `id`s, vLLM's `return_tokens_as_token_ids` ("token_id:N") and `prompt_logprobs`, and the
`/tokenize` endpoints of vLLM, SGLang, llama-server and Linnet (chat `messages` where they take them,
llama-server's `/apply-template` otherwise).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from ..errors import InputError


class ServerFailed(InputError):
    """The server could not be reached, timed out or answered something that is not the API."""


class Refused(ServerFailed):
    """The server answered the request with an HTTP error (a field it does not take, say)."""

    def __init__(self, status: int, message: str, where: str):
        super().__init__(f"{where} answered HTTP {status}: {message}")
        self.status, self.reason = status, message


@dataclass
class Scored:
    """One token as the server reports it: its id where that can be told, its text, its logprob and
    the alternatives it listed, best first."""
    id: int | None
    text: str
    logprob: float | None
    top: list[tuple[int | None, float]] = field(default_factory=list)


def server_root(url: str) -> str:
    """The server's root from an address as people write it: `http://host:port`, or the `/v1` base
    OpenAI clients take (`http://host:port/v1/`)."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise InputError(f"--url must start with http:// or https://, got '{url}'")
    return base[:-3] if base.endswith("/v1") else base


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        self.root, self.timeout = server_root(url), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str) -> dict:
        return self._call(urllib.request.Request(self.root + path, headers=self.headers))

    def post(self, path: str, body: dict, shapes: tuple = (dict,)):
        """The JSON answer, of one of `shapes` (an object, unless said otherwise)."""
        data = json.dumps(body).encode()
        return self._call(urllib.request.Request(self.root + path, data=data, headers=self.headers, method="POST"),
                          shapes)

    def _call(self, request: urllib.request.Request, shapes: tuple = (dict,)):
        where = request.full_url
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise Refused(e.code, _error_message(e.read()), where) from None
        except (urllib.error.URLError, OSError) as e:  # a timeout comes bare or wrapped, by the stage it hit
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise ServerFailed(f"{where} did not answer within {self.timeout:g} s",
                                   hint="--timeout gives a slow server longer") from None
            raise ServerFailed(f"cannot reach {where}: {reason}",
                               hint="is the server running and listening there? (--url takes http://host:port/v1)"
                               ) from None
        try:
            out = json.loads(raw)
        except ValueError:
            raise ServerFailed(f"{where} answered, but not with JSON: {raw[:120]!r}",
                               hint="is this an OpenAI-compatible server?") from None
        if not isinstance(out, shapes):
            raise ServerFailed(f"{where} answered JSON of another shape: {raw[:120]!r}")
        return out

    def optional(self, path: str, body: dict | None = None, shapes: tuple = (dict,)):
        """The answer, or None where the server has no such endpoint or refuses the request's fields."""
        try:
            return self.post(path, body, shapes) if body is not None else self.get(path)
        except Refused as e:
            if e.status in (400, 404, 405, 422, 500, 501):
                return None
            raise


def _error_message(raw: bytes) -> str:
    """An HTTP error's own message: OpenAI's `error.message`, llama-server's, or the body's start."""
    try:
        body = json.loads(raw)
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        return str(msg)[:200] if msg else raw[:200].decode("utf-8", "replace")
    except ValueError:
        return raw[:200].decode("utf-8", "replace")


def first_choice(answer: dict, where: str) -> dict:
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ServerFailed(f"{where} answered without choices: {json.dumps(answer)[:120]}") from None
    if not isinstance(choice, dict):
        raise ServerFailed(f"{where} answered a choice that is not an object")
    return choice


class TokenIds:
    """Tells a reported token's id: the `id` a server gives (llama-server), vLLM's "token_id:N", or
    else its bytes (or text) looked up in the model's vocabulary."""

    def __init__(self, tokenizer):
        self.by_bytes: dict[bytes, int | None] = {}
        for i in range(tokenizer.vocab_size):
            raw = tokenizer.token_bytes(i)
            # bytes two tokens share (or none) name neither: such a token is told by an id or not at all
            self.by_bytes[raw] = None if raw in self.by_bytes or not raw else i

    def __call__(self, entry: dict | None, text: str | None = None) -> int | None:
        if isinstance(entry, dict):
            for key in ("id", "token_id"):
                if isinstance(entry.get(key), int) and not isinstance(entry[key], bool):
                    return entry[key]
            text = entry.get("token")
        if isinstance(text, str) and text.startswith("token_id:") and text[9:].isdigit():
            return int(text[9:])
        raw = entry.get("bytes") if isinstance(entry, dict) else None
        if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
            return self.by_bytes.get(bytes(raw))
        if not isinstance(text, str) or "\ufffd" in text:
            return None
        return self.by_bytes.get(text.encode())


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def read_chat_style(content: list, ids: TokenIds) -> list[Scored]:
    """Chat's `logprobs.content` (and llama-server's completions, which answer in the same shape)."""
    out = []
    for e in content:
        if not isinstance(e, dict):
            raise ServerFailed("a logprobs entry is not an object")
        top = [(ids(t), lp) for t in e.get("top_logprobs") or [] if isinstance(t, dict)
               and (lp := _number(t.get("logprob"))) is not None]
        out.append(Scored(ids(e), str(e.get("token", "")), _number(e.get("logprob")), top))
    return out


def read_completion_style(lp: dict, ids: TokenIds) -> list[Scored]:
    """Completions' `{tokens, token_logprobs, top_logprobs}`; top entries map token text to logprob."""
    tokens, values, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)):
        raise ServerFailed("completions logprobs are not lists")
    out = []
    for k, text in enumerate(tokens):
        top = tops[k] if k < len(tops) and isinstance(tops[k], dict) else {}
        out.append(Scored(ids(None, text), str(text), _number(values[k]) if k < len(values) else None,
                          [(ids(None, t), v) for t, v in top.items() if _number(v) is not None]))
    return out


def read_logprobs(choice: dict, ids: TokenIds) -> list[Scored] | None:
    """A choice's tokens with their logprobs, whichever shape the server used; None without any."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("content"), list):
        return read_chat_style(lp["content"], ids)
    if isinstance(lp.get("tokens"), list):
        return read_completion_style(lp, ids)
    return None


def read_prompt_logprobs(choice: dict, prompt: list[int], n_top: int) -> list[Scored] | None:
    """vLLM's `prompt_logprobs`: per prompt position (the first None) a map of token id to
    `{logprob, rank, decoded_token}` holding the top `n_top` and the prompt's own token."""
    rows = choice.get("prompt_logprobs")
    if not isinstance(rows, list) or len(rows) != len(prompt):
        return None
    out = []
    for token, row in zip(prompt, rows):
        if not isinstance(row, dict):
            out.append(Scored(token, "", None))
            continue
        entries = {int(k): v for k, v in row.items() if str(k).isdigit() and isinstance(v, dict)}
        mine = entries.get(token, {})
        top = sorted(((i, v["logprob"]) for i, v in entries.items() if _number(v.get("logprob")) is not None
                      and not (isinstance(v.get("rank"), int) and v["rank"] > n_top)), key=lambda t: -t[1])
        out.append(Scored(token, str(mine.get("decoded_token", "")), _number(mine.get("logprob")), top))
    return out


def read_llamacpp_native(answer: dict) -> list[Scored] | None:
    """llama-server's own /completion with `return_tokens`: every generated id in `tokens`, and
    `completion_probabilities` entries. Those lose step with the tokens at one that ends inside a UTF-8
    character (its entry is left out and the next ones do not match their positions' distributions),
    so entries are taken while they match the tokens one for one; the rest keep their ids alone."""
    tokens, probs = answer.get("tokens"), answer.get("completion_probabilities")
    if not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) and isinstance(probs, list)):
        return None
    out = [Scored(t, "", None) for t in tokens]
    for k, (token, e) in enumerate(zip(tokens, probs)):
        if not isinstance(e, dict) or e.get("id") != token:
            break
        top = [(t.get("id"), lp) for t in e.get("top_logprobs") or [] if isinstance(t, dict)
               and isinstance(t.get("id"), int) and (lp := _number(t.get("logprob"))) is not None]
        out[k] = Scored(token, str(e.get("token", "")), _number(e.get("logprob")), top)
    return out
