"""Generation over one cache row of a session: prefill, then decode until EOS or the budget."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..errors import InputError
from .sampling import Sampler
from .session import Session


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prefill through the first token
    decode_s: float = 0.0  # every token after the first
    finish_reason: str = "length"

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0


@dataclass
class Generation:
    """Iterate to get new token ids as they are chosen; `stats` fills in along the way."""

    session: Session
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler | None = None
    stop_ids: Iterable[int] = ()
    slot: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InputError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if len(self.prompt) >= self.session.cache_len:
            raise InputError(
                f"the prompt has {len(self.prompt)} tokens; the cache holds {self.session.cache_len} positions",
                hint="use a shorter prompt, or compile with a larger --cache-len",
            )

    def __iter__(self) -> Iterator[int]:
        stop = set(self.stop_ids)
        s, st = self.session, self.stats
        st.prompt_tokens = len(self.prompt)
        budget = min(self.max_new_tokens, s.cache_len - len(self.prompt))
        t0 = time.perf_counter()
        token = s.prefill(self.prompt, slot=self.slot, sampler=self.sampler).tokens[0]
        st.ttft_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        pos = len(self.prompt)
        while True:
            if token in stop:
                st.finish_reason = "stop"
                break
            st.new_tokens += 1
            yield token
            if st.new_tokens >= budget:
                break
            token = s.decode([token], [pos], [self.slot], samplers=[self.sampler]).tokens[0]
            pos += 1
        st.decode_s = time.perf_counter() - t1
