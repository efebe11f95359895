"""Structured output: a grammar that every token a request produces must keep valid, through xgrammar
(the engine vLLM and SGLang use; per-token mask fill measured at 3 us median here against
llguidance's 26 at a 151,936-token vocabulary: `bench/grammar_mask.py`).

`Grammars` holds one tokenizer's vocabulary as xgrammar sees it and compiles what requests ask for
(a JSON schema, any JSON object, a regular expression, a list of choices, a GBNF or Lark grammar);
`Constraint` is one request's matcher: the allowed-token mask for its next token and the tokens it
took. Special tokens (chat markers) are never allowed inside the text; a finished grammar allows
only the model's end-of-sequence tokens.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InputError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark", "tool_calls")
MAX_SOURCE_CHARS = 1 << 16  # a schema or grammar's text
MAX_CHOICES = 256


class GrammarError(InputError):
    """A schema or grammar the engine cannot compile (a client error)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: `kind` (KINDS) and its source text (for choice: a
    JSON list of strings; for tool_calls: JSON {schema, prefix, suffix, separator, most, open, close,
    lead}, one to `most` calls, each the schema's JSON between prefix and suffix, all between open
    and close, after the `lead` token ids)."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind '{self.kind}'; the kinds are {', '.join(KINDS)}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"the {self.kind} is {len(self.source)} characters; the limit is {MAX_SOURCE_CHARS}")


def grammar_kind(source: str) -> str:
    """GBNF (`rule ::= ...`, llama.cpp's and xgrammar's EBNF) unless it reads as Lark (`rule: ...`), as vLLM guesses."""
    return "grammar" if "::=" in source else "lark"


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InputError("structured output needs xgrammar, which is not installed",
                         hint="pip install 'linnet[serve]'") from None
    return xgrammar


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar and the tokens it must never take whatever xgrammar allows (None: none)."""

    grammar: Any
    forbidden: torch.Tensor | None = None  # bool [V]
    lead: tuple[int, ...] = ()  # tokens forced before the grammar starts (a marker that is a special token)


class Grammars:
    """A tokenizer's grammar compiler: built once (about a second for 150k tokens), then compiling
    each request's grammar in milliseconds, cached by source."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        xgr = _xgrammar()
        special = tokenizer.special_ids()
        # bytes per id; a special token as b"" (xgrammar never allows those inside the text)
        vocab = [b"" if i in special else tokenizer.token_bytes(i) for i in range(min(tokenizer.vocab_size, vocab_size))]
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=sorted(eos_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        # JSON forbids raw control characters in strings, and compact JSON has none between elements,
        # but xgrammar's JSON strings take any character but '"', '\\' and line breaks: tokens holding a
        # byte below 0x20 are kept out of JSON answers here
        self._control = torch.zeros(vocab_size, dtype=torch.bool)
        self._control[[i for i, b in enumerate(vocab) if any(c < 0x20 for c in b)]] = True
        self._control_in_line = torch.zeros(vocab_size, dtype=torch.bool)  # a call's markers take line breaks
        self._control_in_line[[i for i, b in enumerate(vocab) if any(c < 0x20 and c != 0x0A for c in b)]] = True

    def compile(self, spec: GrammarSpec) -> Compiled:
        """The compiled grammar; GrammarError naming what is wrong."""
        grammar = self._compile(spec)
        forbidden = {"json_object": self._control, "json_schema": self._control, "tool_calls": self._control_in_line}
        lead = tuple(json.loads(spec.source).get("lead", ())) if spec.kind == "tool_calls" else ()
        return Compiled(grammar, forbidden.get(spec.kind), lead)

    def _compile(self, spec: GrammarSpec) -> Any:
        xgr = _xgrammar()
        try:
            with self._lock:  # the compiler's cache is shared by the server's request threads
                if spec.kind in ("json_object", "json_schema"):
                    schema = spec.source if spec.kind == "json_schema" else '{"type": "object"}'
                    # compact JSON (", " and ": " between elements, as OpenAI's answers): with whitespace
                    # free, a model that keeps choosing it (a random one does) never finishes the object
                    return self.compiler.compile_json_schema(schema, strict_mode=True, any_whitespace=False)
                if spec.kind == "regex":
                    return self.compiler.compile_regex(spec.source)
                if spec.kind == "choice":
                    choices = json.loads(spec.source)
                    return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
                if spec.kind == "lark":
                    return self.compiler.compile_lark(spec.source)
                if spec.kind == "tool_calls":
                    return self.compiler.compile_grammar(_calls_grammar(xgr, json.loads(spec.source)))
                return self.compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)  # xgrammar's log prefix: time, source line
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {first[:300]}") from None


def _calls_grammar(xgr, calls: dict):
    """One to calls["most"] calls in a row, each calls["schema"]'s compact JSON between the prefix and
    the suffix, separated by the separator."""
    def literal(text: str):
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}") if text else None

    def concat(*parts):
        parts = [p for p in parts if p is not None]
        return parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)

    call = xgr.Grammar.from_json_schema(json.dumps(calls["schema"]), any_whitespace=False, strict_mode=True)
    one = concat(literal(calls["prefix"]), call, literal(calls["suffix"]))
    options, sep = [one], literal(calls["separator"])
    for _ in range(1, calls["most"]):
        options.append(concat(options[-1], sep, one))
    listed = options[0] if len(options) == 1 else xgr.Grammar.union(*options)
    return concat(literal(calls.get("open", "")), listed, literal(calls.get("close", "")))


_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_building = threading.Lock()


def grammars(tokenizer, vocab_size: int, eos_ids: set[int]) -> Grammars:
    """The tokenizer's Grammars, built at its first constrained request and kept while it lives."""
    with _building:
        found = _built.get(tokenizer)
        if found is None or found.vocab_size != vocab_size:
            found = _built[tokenizer] = Grammars(tokenizer, vocab_size, eos_ids)
        return found


class Constraint:
    """One request's grammar state: `mask` sets the scores of the tokens the grammar does not allow
    next to -inf, `accept` takes the chosen token, `rollback` takes tokens back."""

    def __init__(self, compiled: Compiled):
        xgr = _xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.forbidden, self.lead = compiled.forbidden, compiled.lead
        self.vocab_size = compiled.grammar.tokenizer_info.vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.accepted = 0

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [V] (float32) with every disallowed token at -inf."""
        if self.accepted < len(self.lead):  # the lead first, token by token
            keep = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
            keep[self.lead[self.accepted]] = True
            return scores.masked_fill(~keep, float("-inf"))
        if self.finished:  # past the grammar's end (ignore_eos): only the stop tokens, as at its end
            keep = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
            keep[[t for t in self.matcher.stop_token_ids if t < scores.shape[-1]]] = True
            return scores.masked_fill(~keep, float("-inf"))
        self.matcher.fill_next_token_bitmask(self._bitmask)
        # bit j of 32-bit word i is token 32 i + j: little-endian bytes, low bit first
        allowed = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[:scores.shape[-1]]
        keep = torch.from_numpy(allowed.view(np.bool_)).to(scores.device)
        if self.forbidden is not None:
            keep &= ~self.forbidden[:keep.shape[0]].to(scores.device)
        return scores.masked_fill(~keep, float("-inf"))

    def accept(self, token: int) -> None:
        if self.accepted < len(self.lead):
            if token != self.lead[self.accepted]:
                raise RuntimeError(f"the grammar's lead is token {self.lead[self.accepted]}, not {token}")
            self.accepted += 1
            return
        if self.finished:
            return
        if not self.matcher.accept_token(token):  # the mask allowed it: only a bug gets here
            raise RuntimeError(f"the grammar refused token {token} its own mask allowed")
        self.accepted += 1

    def rollback(self, to: int) -> None:
        """Back to `to` accepted tokens."""
        if to < self.accepted:
            lead = len(self.lead)
            matched = max(0, self.accepted - lead) - max(0, to - lead)  # the grammar's own, past the lead
            if matched:
                self.matcher.rollback(matched)
            self.accepted = to

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()
