"""Linnet core: one IR for decoder-only LLM checkpoints, and the backends that compile it."""

__version__ = "0.1.0"
