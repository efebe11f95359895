"""Generation over one cache row of a session: prefill, then decode until EOS or the budget."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..errors import InputError
from .sampling import Sampler
from .session import Chunk, Session
from .speculative import Speculation, SpeculativeStats


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
    speculation: Speculation | None = None  # propose tokens and check them in one target step
    stats: GenerationStats = field(default_factory=GenerationStats)
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)

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
        tokens = s.prefill(self.prompt, slot=self.slot, sampler=self.sampler).tokens
        st.ttft_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        context = list(self.prompt)  # what the model has seen, then the token to feed next
        length = self.speculation.length() if self.speculation else None
        try:
            while True:
                for token in tokens:
                    if token in stop:
                        st.finish_reason = "stop"
                        return
                    st.new_tokens += 1
                    context.append(token)
                    yield token
                    if st.new_tokens >= budget:
                        return
                pos = len(context) - 1  # where the last token goes
                # a check of k proposals yields up to k + 1 tokens and writes k + 1 positions
                k = min(length.next(), budget - st.new_tokens - 1, s.cache_len - pos - 1) if length else 0
                draft = self.speculation.propose([(self.slot, context, k, self.sampler)], s.vocab_size)[0] if k > 0 else None
                if draft is None or not draft.tokens:
                    tokens = s.decode([context[-1]], [pos], [self.slot], samplers=[self.sampler]).tokens
                    continue
                chunk = Chunk([context[-1], *draft.tokens], pos, self.slot, self.sampler, draft)
                tokens = s.step_tokens([chunk])[0]
                self.speculative.add(len(draft.tokens), len(tokens) - 1, len(tokens))
                length.observe(len(draft.tokens), len(tokens) - 1)
        finally:
            st.decode_s = time.perf_counter() - t1
