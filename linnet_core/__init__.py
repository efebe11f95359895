"""Linnet core: one IR for decoder-only LLM checkpoints, and the backends that compile it.

    from linnet_core import load_model
    from linnet_core.verify import verify
    session, compiled = load_model("qwen3-4b", backend="torch", dtype="bfloat16", rows=4)
    report = verify("./my-checkpoint", backend="torch", dtype="float16")
"""

__version__ = "0.1.0"

__all__ = ["__version__", "compile_model", "load_model", "open_model"]


def __getattr__(name: str):
    # Lazy, so `import linnet_core` (and the CLI's start-up) does not import torch until needed.
    if name in __all__[1:]:
        from . import compile as _compile

        return getattr(_compile, name)
    raise AttributeError(name)
