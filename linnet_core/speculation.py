"""What `run`, `serve` and `bench` speculate with, from their options: prompt lookup, or a draft
model loaded beside the target (its tokenizer checked against the target's, its rows and cache
length the target's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .bench.machine import decode_bytes_per_step
from .compile import Compiled, Model, load_model, open_model
from .errors import InputError
from .runtime.session import Session
from .runtime.speculative import DEFAULT_DRAFT_TOKENS, DraftModel, PromptLookup, Speculation, draft_cost
from .tokenizer import Tokenizer

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculationOptions:
    """The options as a user gives them: `method` ngram or draft (None: draft when `draft` names a
    model, else no speculation)."""

    method: str | None = None
    draft: str | None = None  # the draft model: folder, GGUF, repo id or short name
    draft_tokens: int = DEFAULT_DRAFT_TOKENS  # the most proposed per step
    adaptive: bool = True  # fewer while the acceptance rate is low
    draft_backend: str | None = None  # None: the target's
    draft_dtype: str = "auto"

    def __post_init__(self):
        if self.method is not None and self.method not in METHODS:
            raise InputError(f"--speculate takes {' or '.join(METHODS)}, got {self.method!r}")
        if self.method == "ngram" and self.draft:
            raise InputError("--speculate ngram proposes from the text itself: drop --draft, or use --speculate draft")
        if self.method == "draft" and not self.draft:
            raise InputError("--speculate draft needs --draft MODEL (a smaller model with the target's tokenizer)")
        Speculation(PromptLookup(), self.draft_tokens)  # the count's bounds, checked before anything loads

    @property
    def chosen(self) -> str | None:
        return self.method or ("draft" if self.draft else None)


def load_speculation(options: SpeculationOptions, target: Compiled, session: Session, *,
                     revision: str | None = None, progress: Callable[[str], None] | None = None
                     ) -> tuple[Speculation | None, Compiled | None]:
    """The Speculation `options` ask for beside the loaded target (None when they ask for none),
    and the draft model's compiled artifact when there is one."""
    method = options.chosen
    if method is None:
        return None, None
    if method == "ngram":
        return Speculation(PromptLookup(), options.draft_tokens, options.adaptive), None
    m = open_model(options.draft, revision)
    check_same_tokenizer(target.model, m)
    draft_session, compiled = load_model(m, options.draft_backend or target.backend, options.draft_dtype,
                                         target.cache_len, session.rows, progress=progress)
    cost = draft_cost(_step_bytes(m, compiled.dtype), _step_bytes(target.model, target.dtype))
    return Speculation(DraftModel(draft_session), options.draft_tokens, options.adaptive, cost), compiled


def check_same_tokenizer(target: Model, draft: Model) -> None:
    """A draft must spell every token as the target does (the same bytes for the same id)."""
    a, b = Tokenizer(target.path), Tokenizer(draft.path)
    n = min(a.vocab_size, b.vocab_size)
    differ = sum(a.token_bytes(i) != b.token_bytes(i) for i in range(n))
    if differ or not n:
        raise InputError(f"the draft model {draft.resolved.name} has another tokenizer than {target.resolved.name} "
                         f"({differ} of {n} token ids spell differently)",
                         hint="a draft must share the target's tokenizer (the same family, e.g. Qwen3-0.6B for Qwen3-4B)")


def _step_bytes(m: Model, dtype: str) -> float:
    return decode_bytes_per_step(m.spec, dtype, 0.0, 1)
