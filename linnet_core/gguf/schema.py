"""The GGUF metadata Linnet reads, typed: each key's GGUF type, range and relation to the other keys
and to the tensors present, checked before the value is used.

A file's values are as untrusted as its bytes: the reader bounds the bytes, this bounds what they
say. A count is an integer of a GGUF integer type within a size no model comes near (so nothing is
allocated or looped over from a number the file's tensors do not back), a float is finite and in
its range, a flag is a GGUF bool, and the vocabulary's token list, token types, scores, merges and
special ids agree with one another and with the token table. Each failure is one line naming the key
and what it holds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UnsupportedModel
from .reader import GGUFError, GGUFFile
from .vocab import CONTROL, NORMAL, USER_DEFINED

UNSIGNED = ("u8", "u16", "u32", "u64")
INTEGERS = (*UNSIGNED, "i8", "i16", "i32", "i64")
FLOATS = ("f32", "f64")
MAX_WIDTH = 1 << 20  # embedding, feed-forward and head widths, head counts: 16x the largest in use
MAX_CONTEXT = 1 << 24
MAX_ADDED_TOKENS = 1 << 17  # control and user-defined pieces: each is matched whole, ~5 us apiece to build
MAX_TOKEN_CHARS = 1024  # 8x the longest piece in use; rebuilding a SentencePiece vocabulary costs length^2 a piece
# gguf.TokenType: 0 undefined, then normal, unknown, control, user-defined, unused, byte
TOKEN_TYPES = range(7)
_LAYER = re.compile(r"blk\.(\d+)\.")
_MISSING = object()


def _shown(value: Any, kind: str) -> str:
    """What a key holds, for an error line."""
    if kind.startswith("array["):
        return f"an array of {len(value)} {kind[6:-1]}"
    if kind == "string":
        return f"the string {value[:40]!r}"
    return f"the {kind} {str(value)[:40]}"


@dataclass(frozen=True)
class Vocabulary:
    """A GGUF's tokenizer keys, checked against one another."""

    model: str  # "gpt2" or "llama"
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[tuple[str, str]]
    pre: str | None
    bos: int | None
    eos: int | None
    eot: int | None
    unknown: int | None
    padding: int | None
    add_bos: bool | None
    add_eos: bool | None
    add_space_prefix: bool | None
    chat_template: str | None


class Metadata:
    """Typed, checked reads of one parsed GGUF's metadata."""

    def __init__(self, g: GGUFFile):
        self.values, self.types, self.path, self.tensors = g.metadata, g.types, g.path, g.tensors

    def fail(self, key: str, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: GGUF key '{key}' {what}")

    def _get(self, key: str, kinds: tuple[str, ...], expected: str, default: Any) -> Any:
        """The value of `key` when it has one of `kinds`; `default` when absent (required if _MISSING)."""
        if key not in self.values:
            if default is _MISSING:
                raise self.fail(key, f"is missing: it must hold {expected}")
            return default
        kind = self.types[key]
        if kind not in kinds:
            raise self.fail(key, f"must hold {expected}, holds {_shown(self.values[key], kind)}")
        return self.values[key]

    def count(self, key: str, default: Any = _MISSING, *, least: int = 1, most: int = MAX_WIDTH,
              per_layer: bool = False) -> int:
        """An integer in [least, most]; `per_layer`: also an array of one per layer, all equal (llama.cpp
        allows per-layer values for some keys; Linnet's decoder has one)."""
        expected = f"an integer from {least} to {most}"
        kinds = INTEGERS + tuple(f"array[{k}]" for k in INTEGERS) if per_layer else INTEGERS
        value = self._get(key, kinds, expected, default)
        if key not in self.values:
            return value
        if isinstance(value, np.ndarray):
            values = {int(v) for v in value}
            if len(values) != 1:
                raise UnsupportedModel(f"{self.path}: GGUF key '{key}' differs between layers "
                                       f"({sorted(values)[:4]}...), which Linnet's decoder does not model")
            value = values.pop()
        if not least <= int(value) <= most:
            raise self.fail(key, f"must hold {expected}, holds {value}")
        return int(value)

    def number(self, key: str, default: Any = _MISSING, *, above: float = 0.0, below: float = math.inf) -> float:
        """A finite float in (above, below)."""
        expected = f"a finite number above {above:g}" + (f" and below {below:g}" if below < math.inf else "")
        value = self._get(key, FLOATS, expected, default)
        if key not in self.values:
            return value
        if not (math.isfinite(value) and above < value < below):
            raise self.fail(key, f"must hold {expected}, holds {value}")
        return float(value)

    def string(self, key: str, default: Any = _MISSING) -> str:
        return self._get(key, ("string",), "a string", default)

    def flag(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, ("bool",), "a bool", default)
        return value if key not in self.values else bool(value)

    # -- the tensors the keys describe ---------------------------------------------------------
    def layers_present(self) -> int:
        """1 + the highest block index a tensor name carries (0 when none does)."""
        return max((int(m.group(1)) + 1 for name in self.tensors if (m := _LAYER.match(name))), default=0)

    def rows(self, tensor: str) -> tuple[int, int] | None:
        """A 2-d tensor's (rows, columns), or None when the file has no such tensor."""
        t = self.tensors.get(tensor)
        return None if t is None or len(t.shape) != 2 else t.shape

    # -- the vocabulary ------------------------------------------------------------------------
    def vocabulary(self) -> Vocabulary | None:
        """The tokenizer keys, checked; None when the file carries no token list."""
        tokens = self._get("tokenizer.ggml.tokens", ("array[string]",), "an array of strings", None)
        if tokens is None:
            return None
        n = len(tokens)
        if not n:
            raise self.fail("tokenizer.ggml.tokens", "holds no tokens")
        longest = max(map(len, tokens))
        if longest > MAX_TOKEN_CHARS:
            raise self.fail("tokenizer.ggml.tokens", f"holds a token of {longest} characters (at most {MAX_TOKEN_CHARS})")
        model = self.string("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModel(f"the GGUF's tokenizer type '{model[:40]}' is not supported (supported: gpt2, llama)",
                                   hint="pass token ids instead")
        types = self._per_token("tokenizer.ggml.token_type", INTEGERS, "token types", n)
        if types is not None and not np.isin(types, TOKEN_TYPES).all():
            bad = int(types[~np.isin(types, TOKEN_TYPES)][0])
            raise self.fail("tokenizer.ggml.token_type", f"must hold token types 0 to 6, holds {bad}")
        added = 0 if types is None else int(np.isin(types, (CONTROL, USER_DEFINED)).sum())
        if added > MAX_ADDED_TOKENS:
            raise self.fail("tokenizer.ggml.token_type", f"marks {added} tokens control or user-defined "
                                                         f"(at most {MAX_ADDED_TOKENS})")
        scores = self._per_token("tokenizer.ggml.scores", FLOATS, "scores", n)
        if scores is not None and not np.isfinite(scores).all():
            raise self.fail("tokenizer.ggml.scores", "must hold finite scores, holds a NaN or an infinity")
        ids = {k: self._token_id(f"tokenizer.ggml.{k}_token_id", n) for k in ("bos", "eos", "eot", "unknown", "padding")}
        return Vocabulary(
            model=model, tokens=tokens, types=[NORMAL] * n if types is None else types.astype(int).tolist(),
            scores=None if scores is None else scores.astype(float).tolist(),
            merges=self._merges(tokens), pre=self.string("tokenizer.ggml.pre", None),
            **ids, add_bos=self.flag("tokenizer.ggml.add_bos_token", None),
            add_eos=self.flag("tokenizer.ggml.add_eos_token", None),
            add_space_prefix=self.flag("tokenizer.ggml.add_space_prefix", None),
            chat_template=self.string("tokenizer.chat_template", None),
        )

    def _per_token(self, key: str, kinds: tuple[str, ...], what: str, n: int) -> np.ndarray | None:
        values = self._get(key, tuple(f"array[{k}]" for k in kinds), f"an array of {what}, one per token", None)
        if values is not None and len(values) != n:
            raise self.fail(key, f"holds {len(values)} {what} for {n} tokens")
        return values

    def _token_id(self, key: str, n: int) -> int | None:
        return self.count(key, None, least=0, most=n - 1)

    def _merges(self, tokens: list[str]) -> list[tuple[str, str]]:
        """Each merge "a b" of two vocabulary pieces whose join is one too (what a BPE model needs)."""
        key = "tokenizer.ggml.merges"
        merges = self._get(key, ("array[string]",), "an array of strings", [])
        known, out = set(tokens), []
        for i, m in enumerate(merges):
            a, space, b = m.partition(" ")
            if not space or a not in known or b not in known or a + b not in known:
                raise self.fail(key, f"entry {i} ({m[:40]!r}) is not two vocabulary pieces whose join is one")
            out.append((a, b))
        return out
