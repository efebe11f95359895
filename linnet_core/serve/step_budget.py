"""How many prompt tokens a step may carry beside its decoding rows.

Every decoding row waits for the whole step, so a step that carries a long prompt chunk is a long
gap between two of their tokens. The budget keeps a step with decoding rows under `stall` times a
decode-only step, as vLLM's chunked prefill bounds a step by its token budget and llama.cpp by
n_batch, but in time, since on a CPU a prompt token costs far more than on a GPU. The time is
modelled from the steps the engine has run: seconds = base + per_token x tokens, fitted by least
squares with older steps fading (decode-only steps and mixed ones both inform it, so it holds when
prompt work never stops).

Two cases move the bound. Rows waiting for their prompts are idle capacity too, so when they
outnumber the decoding rows the bound grows by that ratio, and at `FEW_DECODING` times as many it
goes (a burst of arrivals is computed at once, not trickled beside one decoding row). And when every
decoding row ends within `DRAIN_STEPS` steps (its max_tokens or the cache's end), or before the
waiting prompts would be through at the bound anyway, prompt work waits for them: it then stalls
nobody. With no row decoding nobody waits: every prompt advances up to `max_chunk`, at most
`BURST_CHUNKS` chunks' worth in all (a step's activations grow with its tokens).
"""

from __future__ import annotations

KEEP = 0.95  # weight left to the steps before each new one (about the last 20 steps count)
DRAIN_STEPS = 4  # prompt work waits while every decoding row ends within this many steps
BURST_CHUNKS = 4  # with nobody decoding, a step takes at most this many chunks' worth of prompt tokens
FEW_DECODING = 3  # rows waiting for prompts this many times the decoding ones: bound lifted


class StepBudget:
    def __init__(self, max_chunk: int, stall: float | None):
        if stall is not None and stall < 1.0:
            raise ValueError(f"a step's stall factor is at least 1, got {stall}")
        self.max_chunk, self.stall = max_chunk, stall
        self._sums = [0.0] * 5  # faded sums of 1, x, y, x*x, x*y: x a step's tokens, y its seconds

    def observe(self, prompt_tokens: int, decoding: int, seconds: float) -> None:
        """One step's time: `prompt_tokens` prompt tokens beside `decoding` one-token rows."""
        x = prompt_tokens + decoding
        for i, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            self._sums[i] = KEEP * self._sums[i] + v

    def cost(self) -> tuple[float, float] | None:
        """(base seconds, seconds per token) of a step, or None until steps of different sizes were seen."""
        n, sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx
        if n == 0 or spread <= 1e-9 * max(1.0, n * sxx):
            return None
        per_token = (n * sxy - sx * sy) / spread
        if per_token <= 0:
            return None
        return max(0.0, (sy - per_token * sx) / n), per_token

    def prompt_tokens(self, decoding: int, prefilling: int = 1, draining_in: int | None = None,
                      pending: int = 0) -> int:
        """Prompt tokens the next step may take when `decoding` rows decode in it and `prefilling` rows
        wait for their prompts (`pending` tokens in all); `draining_in`: the steps until the last
        decoding row ends, if known."""
        if not decoding:
            return self.max_chunk * min(max(1, prefilling), BURST_CHUNKS)
        fit = self.cost() if self.stall is not None else None
        if fit is None:
            return self.max_chunk  # no bound, or too little measured yet: the first steps find out
        base, per_token = fit
        room = max(1, int((self.stall - 1.0) * (base + per_token * decoding) / per_token))
        if draining_in is not None and draining_in <= max(DRAIN_STEPS, -(-pending // room)):
            return 0  # the decoding rows end before the prompts would be through at this bound: they wait
        if prefilling >= FEW_DECODING * decoding:  # the few decoding rows wait one long step; the rest start
            return self.prompt_tokens(0, prefilling)
        return max(1, min(self.max_chunk * max(1, prefilling), int(room * max(1.0, prefilling / decoding))))
