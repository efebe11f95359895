"""Linnet core: one IR for decoder-only LLM checkpoints, and the backends that compile it.

    from linnet_core import load_model, verify
    session, compiled = load_model("qwen3-4b", backend="torch", dtype="bfloat16", rows=4)
    report = verify("./my-checkpoint", backend="torch", dtype="float16")

    from linnet_core import export_hf, export_gguf
    export_hf("qwen3-4b", "out/qwen3-4b-hf", dtype="bfloat16")   # checked in transformers
    export_gguf("qwen3-4b", "out/qwen3-4b.gguf", dtype="q8_0")    # checked in llama.cpp
"""

__version__ = "0.1.0"

# name -> the module that defines it; imported lazily, so `import linnet_core` (and the CLI's
# start-up) does not import torch until needed.
_LAZY = {"compile_model": "compile", "load_model": "compile", "open_model": "compile",
         "export_hf": "export.hf_export", "export_gguf": "export.gguf_export", "export_onnx": "export.onnx_export",
         "read_gguf": "gguf.reader", "verify": "check.verify"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)
