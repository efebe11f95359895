"""A llama_cpp.Llama opened so that it runs on this CPU.

ggml's AMX matmul crashes the whole process at its first evaluation on some Xeons (llama.cpp issue
20824; q8_0 and q4_0 weights in llama-cpp-python 0.3.36 built natively, seen here): where the CPU
has AMX, llama.cpp's extra buffer types (the AMX ones and its repacked weights) stay off, as
llama-server's --no-repack keeps them. Kept light: the bench's llama.cpp worker imports it without
PyTorch.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_has_amx() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no such crash reported
        return False
    return any(line.startswith("flags") and "amx_int8" in line.split() for line in text.splitlines())


def open_llama(**kwargs):
    """`llama_cpp.Llama(**kwargs)`, without llama.cpp's extra buffer types on a CPU with AMX."""
    from llama_cpp import Llama

    if not cpu_has_amx():
        return Llama(**kwargs)
    import llama_cpp.llama_cpp as bindings  # Llama takes its model parameters' defaults from here

    default = bindings.llama_model_default_params

    def without_extra_buffers():
        params = default()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_buffers
    try:
        return Llama(**kwargs)
    finally:
        bindings.llama_model_default_params = default
