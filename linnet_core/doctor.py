"""`linnet doctor`: what this machine can run, and for what it cannot, why and what to install.

Every backend answers through its own `check_available` (the same check `compile` makes), so the
report and the commands never disagree.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from dataclasses import asdict, dataclass

from .artifact_store import STORE_ENV
from .backends import BACKEND_NAMES, get_backend
from .errors import BackendUnavailable, CacheError


@dataclass
class Check:
    name: str
    ready: bool
    detail: str  # a version, or the one-line reason
    fix: str | None = None  # the command that would make it ready

    def to_json(self) -> dict:
        return asdict(self)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def platform_checks() -> list[Check]:
    import torch

    checks = [Check("Python", True, f"{platform.python_version()} ({sys.executable})"),
              Check("PyTorch", True, f"{torch.__version__}, {torch.get_num_threads()} threads")]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        driver = _nvidia_driver()
        checks.append(Check("GPU", True, f"{names}; CUDA {torch.version.cuda}" + (f", driver {driver}" if driver else "")))
    else:
        why = "this PyTorch is a CPU build" if torch.version.cuda is None else "no NVIDIA GPU is visible"
        checks.append(Check("GPU", False, why, "install a CUDA build of PyTorch on a machine with an NVIDIA GPU"
                            if torch.version.cuda is None else None))
    from .backends.cpu.build import status as kernel_status  # imports torch: doctor's other checks run without it

    ready, detail = kernel_status()
    checks.append(Check("CPU kernels", ready, detail))
    return checks


def _nvidia_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - no NVML bindings or driver: the line goes without it
        return None


def package_checks() -> list[Check]:
    """The optional toolchains, with what each brings."""
    out = []
    if importlib.util.find_spec("jax"):
        import jax

        out.append(Check("JAX", True, f"{jax.__version__}, devices: {', '.join(sorted({d.platform for d in jax.devices()}))}"))
    else:
        out.append(Check("JAX", False, "not installed", "pip install 'linnet[jax]'"))
    if importlib.util.find_spec("onnxruntime"):
        import onnxruntime as ort

        out.append(Check("ONNX Runtime", True, f"{ort.__version__}, providers: {', '.join(ort.get_available_providers())}"))
    else:
        out.append(Check("ONNX Runtime", False, "not installed", "pip install 'linnet[onnx]'"))
    trt = _version("tensorrt")
    out.append(Check("TensorRT", bool(trt), trt or "not installed", None if trt else "pip install 'linnet[gpu]'"))
    llama = _version("llama-cpp-python")
    out.append(Check("llama.cpp bindings", bool(llama), f"llama-cpp-python {llama}" if llama else "not installed",
                     None if llama else "pip install 'linnet[llamacpp]'"))
    gguf = _version("gguf")
    out.append(Check("GGUF writer", bool(gguf), f"gguf {gguf}" if gguf else "not installed",
                     None if gguf else "pip install 'linnet[gguf]'"))
    ray = _version("ray")
    out.append(Check("Ray Serve (serve --ray)", bool(ray) and bool(importlib.util.find_spec("ray.serve")),
                     f"ray {ray}" if ray else "not installed", None if ray else "pip install 'linnet[ray]'"))
    return out


def backend_checks(dtype: str = "float32") -> list[Check]:
    out = []
    for name in BACKEND_NAMES:
        backend = get_backend(name)
        try:
            backend.check_available(dtype)
        except BackendUnavailable as e:
            out.append(Check(name, False, e.message, e.hint))
        else:
            out.append(Check(name, True, f"{backend.title} ({', '.join(backend.dtypes)})"))
    return out


def cache_check() -> Check:
    from .cache import ArtifactCache  # imports torch: not at start-up

    cache = ArtifactCache()
    try:
        cache._prepare()
    except CacheError as e:
        return Check("artifact cache", False, e.message, e.hint)
    source = "LINNET_CACHE" if os.environ.get("LINNET_CACHE") else "default"
    shared = f"; shared store {cache.shared.url} ({STORE_ENV})" if cache.shared else ""
    return Check("artifact cache", True, f"{cache.root} ({source}){shared}")


def diagnose() -> dict[str, list[Check]]:
    return {"platform": platform_checks() + [cache_check()], "packages": package_checks(),
            "backends": backend_checks()}
