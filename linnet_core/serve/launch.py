"""What every serving face does first: the model loaded as a ServeConfig says, its tokenizer (None:
the model takes token ids only), and the engine over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..compile import Compiled, load_model
from ..errors import CheckpointError
from ..runtime.session import Session
from ..tokenizer import Tokenizer
from .config import ServeConfig
from .engine import Engine


@dataclass
class Served:
    engine: Engine
    session: Session
    compiled: Compiled
    tokenizer: Tokenizer | None


def launch(config: ServeConfig, progress: Callable[[str], None] | None = None) -> Served:
    """Load the model for `config` and build its engine (not started)."""
    session, compiled = load_model(config.model, config.backend, config.dtype, config.cache_len, rows=config.rows,
                                   progress=progress)
    try:
        tokenizer = Tokenizer(compiled.model.path)
    except CheckpointError:
        tokenizer = None  # token ids only
    return Served(Engine.from_config(session, tokenizer, config), session, compiled, tokenizer)
