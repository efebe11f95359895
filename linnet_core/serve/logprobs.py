"""Log-probabilities in the OpenAI API's two shapes: chat's `{"content": [{token, logprob, bytes,
top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`."""

from __future__ import annotations

from ..runtime.sampling import TokenLogprobs
from ..tokenizer import Tokenizer


class TokenNames:
    """Each token's text and bytes as logprobs report them: its decoded bytes (a piece of a UTF-8
    character shows U+FFFD in the text, its bytes in full), or `token_id:N` without a tokenizer."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        named = self._cache.get(token)
        if named is None:
            if self.tokenizer is None:
                text = f"token_id:{token}"
                named = (text, text.encode())
            else:
                raw = self.tokenizer.token_bytes(token)
                named = (raw.decode("utf-8", errors="replace"), raw)
            if len(self._cache) < 1 << 16:
                self._cache[token] = named
        return named


def chat_content(names: TokenNames, items: list[TokenLogprobs]) -> list[dict]:
    """Chat's `logprobs.content` entries for these tokens."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = names(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items]


def completion_logprobs(names: TokenNames, items: list[TokenLogprobs], offset: int = 0) -> dict:
    """Completions' `logprobs` for these tokens, offsets counted in characters from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in items:
        text, _ = names(lp.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in lp.top:  # best first: where two tokens read alike (U+FFFD), the likelier keeps the key
            top.setdefault(names(t)[0], v)
        out["top_logprobs"].append(top or None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def cumulative(items: list[TokenLogprobs]) -> float:
    """A choice's total log-probability (how best_of ranks its candidates)."""
    return sum(lp.logprob for lp in items)
