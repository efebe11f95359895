"""What every serving face does first: the model loaded as a ServeConfig says, its tokenizer (None:
the model takes token ids only), and the engine over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..compile import Compiled, load_model
from ..errors import CheckpointError
from ..runtime.session import Session
from ..speculation import SpeculationOptions, load_speculation
from ..tokenizer import Tokenizer
from .config import ServeConfig
from .engine import Engine


@dataclass
class Served:
    engine: Engine
    session: Session
    compiled: Compiled
    tokenizer: Tokenizer | None
    draft: Compiled | None = None  # the draft model speculative decoding proposes with


def launch(config: ServeConfig, progress: Callable[[str], None] | None = None) -> Served:
    """Load the model for `config` (and its draft model) and build its engine (not started)."""
    wanted = speculation_options(config)  # checked before anything loads
    session, compiled = load_model(config.model, config.backend, config.dtype, config.cache_len, rows=config.rows,
                                   progress=progress)
    speculation, draft = load_speculation(wanted, compiled, session, progress=progress)
    try:
        tokenizer = Tokenizer(compiled.model.path)
    except CheckpointError:
        tokenizer = None  # token ids only
    engine = Engine.from_config(session, tokenizer, config, speculation=speculation)
    return Served(engine, session, compiled, tokenizer, draft)


def speculation_options(config: ServeConfig) -> SpeculationOptions:
    return SpeculationOptions(config.speculate, config.draft, config.draft_tokens, config.adaptive_draft,
                              config.draft_backend, config.draft_dtype)
