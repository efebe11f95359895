"""Typed errors. Each carries one line for people and a hint; the CLI maps them to exit codes."""

from __future__ import annotations


class LinnetError(Exception):
    """Base of every error Linnet reports to a user (never a bug: bugs are plain exceptions)."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ModelNotFound(LinnetError):
    """The model is neither a local folder, nor in the Hugging Face cache, nor reachable."""


class UnsupportedModel(LinnetError):
    """The checkpoint's architecture, rope type or a config value is outside what Linnet covers."""


class CheckpointError(LinnetError):
    """A checkpoint file is unsafe, corrupt, truncated, or disagrees with its config."""


class IRError(LinnetError):
    """The IR verifier refused a graph: a bug in a graph builder or a pass."""


class BackendUnavailable(LinnetError):
    """The backend cannot run here (missing package, no GPU, no kernel for a dtype)."""


class CacheError(LinnetError):
    """The artifact cache cannot be used (unwritable folder, broken entry that cannot be rebuilt)."""


class InputError(LinnetError):
    """A request cannot be served as asked (prompt longer than the cache, bad sampling values)."""


class VerifyFailed(LinnetError):
    """A backend's distance from the reference is past the tolerance for its dtype (or an export's
    round trip failed): its own exit code, so a script can tell "wrong numbers" from "did not run"."""

    exit_code = 3
