"""llama.cpp (through llama-cpp-python) as a reference: a GGUF's logits as the engine it is for computes them.

Used where a GGUF is the thing checked: an export's round trip, and `verify` of a model read from a
GGUF. A float32 KV cache (llama.cpp's default is f16) and every position's logits, so a distance is
the weights' and kernels' own. llama.cpp logs from C to file descriptor 2; that is kept off the
command's output, and its error lines give the reason when a file does not load.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..check.reference import ReferenceRun
from ..errors import BackendUnavailable, CheckpointError
from .llama_open import open_llama

INSTALL = "pip install 'linnet[llamacpp]'"
# What llama.cpp's CPU dot products round activations to, by the type of the GGUF's matrices.
LLAMACPP_ACTIVATIONS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "int8", "Q4_0": "int8"}


def llamacpp_activations(spec, weights: str) -> str:
    """The rounding of a model's activations in llama.cpp on a file of `weights` (K-quants: "int8/256").
    ggml's CPU gelu reads its result from a float16 table (GGML_GELU_FP16), so a gelu model computes
    no finer than float16 there, whatever the file's type."""
    rounding = LLAMACPP_ACTIVATIONS.get(weights, "int8/256")
    return "float16" if rounding == "float32" and spec.hidden_act.startswith("gelu") else rounding


class LlamaCppRefused(CheckpointError):
    """llama.cpp did not load the file (its own reason in the message)."""


@contextmanager
def native_stderr_kept(log: list[str] | None = None) -> Iterator[None]:
    """File descriptor 2 into a temporary file for the block, and Python's sys.stderr (where
    llama-cpp-python's log callback prints llama.cpp's errors) into a buffer; their lines into `log`."""
    sys.stderr.flush()
    saved, saved_py, py_log = os.dup(2), sys.stderr, io.StringIO()
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        sys.stderr = py_log
        try:
            yield
        finally:
            sys.stderr = saved_py
            os.dup2(saved, 2)
            os.close(saved)
            if log is not None:
                sink.seek(0)
                log.extend(sink.read().decode("utf-8", errors="replace").splitlines() + py_log.getvalue().splitlines())


def load_failure_cause(log: list[str]) -> str | None:
    """llama.cpp's own reason a model did not load ("error loading model vocabulary: unordered_map::at")."""
    for line in log:
        if "error loading model" in line:
            return line.split(": ", 1)[-1].strip()
    return None


@contextmanager
def llamacpp(file: Path, positions: int) -> Iterator:
    """A llama_cpp.Llama over `file` with room for `positions` tokens, closed after the block."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise BackendUnavailable("llama.cpp is the reference for a GGUF, and llama-cpp-python is not installed",
                                 hint=INSTALL) from None
    import torch
    from llama_cpp._logger import set_verbose

    log: list[str] = []
    try:
        # verbose=True: quiet, llama-cpp-python sends the loader's log to /dev/null, reason and all;
        # here every line lands in `log` instead.
        with native_stderr_kept(log):
            llm = open_llama(model_path=str(file), n_ctx=positions, n_batch=positions, logits_all=True, verbose=True,
                             n_threads=torch.get_num_threads() or os.cpu_count(), type_k=0, type_v=0, flash_attn=False)
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file", without the reason
        raise LlamaCppRefused(f"llama.cpp refuses the GGUF: {load_failure_cause(log) or e}") from None
    finally:
        set_verbose(False)
    try:
        yield llm
    finally:
        with native_stderr_kept():
            llm.close()


def run_llamacpp(file: Path, ids: list[int], steps: int, feed: list[int] | None = None) -> ReferenceRun:
    """Logits over `ids`, then `steps` decode steps fed llama.cpp's own greedy tokens, or `feed`."""
    n = len(ids) + steps
    with llamacpp(file, n) as llm, native_stderr_kept():
        if feed is not None:
            llm.eval(list(ids) + list(feed[:steps]))
        else:
            llm.eval(list(ids))
            for k in range(steps):
                llm.eval([int(np.argmax(llm.scores[len(ids) - 1 + k]))])
        logits = np.array(llm.scores[:n], dtype=np.float32)  # [T + steps, V]
    return ReferenceRun(logits, [int(t) for t in logits[len(ids) - 1:].argmax(-1)])
