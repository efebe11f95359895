"""Typed errors. Each carries one line for people and a hint; the CLI maps them to exit codes."""

from __future__ import annotations


class LinnetError(Exception):
    """Base of every error Linnet reports to a user as one line and a hint. Almost all are about
    the input or the machine; `bug` marks the kinds that mean Linnet itself is wrong (IRError).
    Other bugs are plain exceptions."""

    exit_code = 1
    default_hint: str | None = None  # what to try when the raiser had nothing more specific to say
    bug = False

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint

    def __str__(self) -> str:
        return self.message


class ModelNotFound(LinnetError):
    """The model is neither a local folder, nor in the Hugging Face cache, nor reachable."""

    default_hint = "give a checkpoint folder, a Hugging Face repo id, or a short name from `linnet models`"


class UnsupportedModel(LinnetError):
    """The checkpoint's architecture, rope type or a config value is outside what Linnet covers."""

    default_hint = "`linnet models` lists checkpoints known to work"


class CheckpointError(LinnetError):
    """A checkpoint file is unsafe, corrupt, truncated, or disagrees with its config."""

    default_hint = "re-download the checkpoint, or check that its files and config.json belong together"


class IRError(LinnetError):
    """The IR verifier refused a graph: a bug in a graph builder or a pass."""

    default_hint = "this is a bug in Linnet: run again with LINNET_DEBUG=1 and report the traceback"
    bug = True


class BackendUnavailable(LinnetError):
    """The backend cannot run here (missing package, no GPU, no kernel for a dtype)."""

    default_hint = "`linnet doctor` lists what this machine can run and what to install"


class CacheError(LinnetError):
    """The artifact cache cannot be used (unwritable folder, broken entry that cannot be rebuilt)."""

    default_hint = "point LINNET_CACHE at a writable folder, or clear the entry with `linnet cache rm`"


class InputError(LinnetError):
    """A request cannot be served as asked (prompt longer than the cache, bad sampling values)."""

    default_hint = "see the command's --help"


class VerifyFailed(LinnetError):
    """A backend's distance from the reference is past the tolerance for its dtype (or an export's
    round trip failed): its own exit code, so a script can tell "wrong numbers" from "did not run"."""

    default_hint = "try a wider dtype (float32), or report the model and backend"

    exit_code = 3
