"""How many prompt tokens a step may carry beside its decoding rows.

Every decoding row waits for the whole step, so a step that carries a long prompt chunk is a long
gap between two of their tokens. The budget keeps a step with decoding rows under `stall` times a
decode-only step, from the step times measured as the engine runs (a decode-only step's time and
the added time per prompt token, each a moving average), as vLLM's chunked prefill bounds a step by
its token budget and llama.cpp by n_batch, but in time, since on a CPU a prompt token costs far more
than on a GPU. With no row decoding nobody waits, and the step takes up to `max_chunk` tokens.
"""

from __future__ import annotations

DECAY = 0.2  # weight of the newest measurement in each moving average


class StepBudget:
    def __init__(self, max_chunk: int, stall: float | None):
        if stall is not None and stall < 1.0:
            raise ValueError(f"a step's stall factor is at least 1, got {stall}")
        self.max_chunk, self.stall = max_chunk, stall
        self.decode_s: float | None = None  # a decode-only step
        self.token_s: float | None = None  # what one prompt token adds to a step

    def prompt_tokens(self, decoding: int) -> int:
        """Prompt tokens the next step may take when `decoding` rows decode in it (at least one)."""
        if self.stall is None or decoding == 0 or self.decode_s is None or self.token_s is None:
            return self.max_chunk  # nobody waits, or nothing measured yet: the first steps find out
        room = (self.stall - 1.0) * self.decode_s / self.token_s
        return max(1, min(self.max_chunk, int(room)))

    def observe(self, prompt_tokens: int, decoding: int, seconds: float) -> None:
        """One step's time: `prompt_tokens` prompt tokens beside `decoding` one-token rows."""
        if prompt_tokens == 0:
            self.decode_s = _mix(self.decode_s, seconds)
        elif decoding and self.decode_s is not None:
            self.token_s = _mix(self.token_s, max(seconds - self.decode_s, 0.0) / prompt_tokens)
        elif self.token_s is None:  # a prompt-only step: an upper bound until mixed steps refine it
            self.token_s = seconds / prompt_tokens


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - DECAY) * old + DECAY * new
