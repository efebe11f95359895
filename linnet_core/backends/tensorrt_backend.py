"""Backend `tensorrt`: the emitted ONNX graph built into a TensorRT engine (ONNX Runtime's TensorRT
execution provider), with the engine and the timing cache kept inside the artifact.

The engine is built at compile time, so the artifact holds it and a cache hit is a load; the
key includes the GPU model and the TensorRT version, since an engine is only valid for both.
Norms (RMSNormalization, stash_type float) and softmax (explicit float casts) stay in float32 in
the graph, which is what keeps float16 from drifting. Why the ONNX Runtime provider rather
than the `tensorrt` builder directly: the same I/O-bound session serves both backends, and the
provider falls back to CUDA for any node TensorRT rejects instead of failing the build.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import BackendUnavailable
from ..runtime.session import Session
from .artifact import read_info
from .onnx_emit import DENSE_INPUTS
from .ort_backend import OnnxRuntimeBackend, cuda_provider_options, import_ort, torch_cuda_place

GPU_HINT = "pip install 'linnet[gpu]' (onnxruntime-gpu and tensorrt) on a machine with an NVIDIA GPU"
MAX_ROWS = 64  # the largest batch of cache rows the engine's optimisation profile admits


def profile_shapes(cache: dict, cache_len: int, rows: int, b: int, t: int) -> str:
    """One TensorRT optimisation-profile point over the dense step's inputs (onnx_emit's names and
    symbolic dims: B -> b, T -> t) and every layer's cache: "name:AxB,..."."""
    size = {"B": b, "T": t}
    dims = [f"{name}:{'x'.join(str(size.get(d, d)) for d in shape)}" for name, (shape, _) in DENSE_INPUTS.items()]
    layout = f"{rows}x{cache['kv_heads']}x{cache_len}x{cache['head_dim']}"
    dims += [f"{kind}_cache.{i}:{layout}" for kind in ("k", "v") for i in range(cache["layers"])]
    return ",".join(dims)


def tensorrt_provider_options(info: dict, engine_dir: Path, max_rows: int) -> dict[str, str]:
    """The TensorRT provider's options for an artifact: engine and timing cache inside it, the
    dtype's precision flag, and one profile from a single token of one row up to `max_rows` rows of
    the whole cache length."""
    c, n, dtype = info["cache"], info["cache_len"], info["dtype"]
    return {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(engine_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(engine_dir),
        "trt_fp16_enable": str(dtype == "float16"),
        "trt_bf16_enable": str(dtype == "bfloat16"),
        "trt_profile_min_shapes": profile_shapes(c, n, 1, 1, 1),
        "trt_profile_opt_shapes": profile_shapes(c, n, 1, 1, 1),
        "trt_profile_max_shapes": profile_shapes(c, n, max_rows, max_rows, n),
    }


def _tensorrt_version() -> str:
    try:
        import tensorrt
    except ImportError:
        raise BackendUnavailable("TensorRT is not installed", hint=GPU_HINT) from None
    return tensorrt.__version__


class TensorRTBackend(OnnxRuntimeBackend):
    name = "tensorrt"
    title = "TensorRT"
    artifact_format = "2"
    ragged = False  # one optimisation profile over the fixed [B, T] inputs
    loads_at_compile = True  # the engine is built by a first session

    def check_available(self, dtype: str) -> None:
        self.check_device("cuda")
        super().check_available(dtype)

    def check_device(self, device: str) -> None:
        if device != "cuda":
            raise BackendUnavailable("TensorRT runs on NVIDIA GPUs only", hint="use --backend onnxruntime on the CPU")
        if not torch.cuda.is_available():
            raise BackendUnavailable("TensorRT needs an NVIDIA GPU, and none is visible here", hint=GPU_HINT)
        _tensorrt_version()
        if "TensorrtExecutionProvider" not in import_ort().get_available_providers():
            raise BackendUnavailable("this ONNX Runtime has no TensorRT execution provider", hint=GPU_HINT)

    def toolchain(self) -> dict[str, str]:
        return {**super().toolchain(), "tensorrt": _tensorrt_version(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none"}

    def providers(self, device: str) -> list[str]:
        return ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]

    def provider_options(self, artifact: Path, device: str) -> list[dict[str, str]]:
        place = torch_cuda_place()
        trt = tensorrt_provider_options(read_info(artifact), artifact / "tensorrt", MAX_ROWS)
        return [{**trt, **cuda_provider_options(*place)}, cuda_provider_options(*place), {}]

    def finish(self, out: Path) -> None:
        (out / "tensorrt").mkdir()
        # Build the engine now, into the artifact, so that every later run is a load.
        session = self.load(out, rows=1)
        session.prefill([0], slot=0)
        del session

    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        if rows > MAX_ROWS:
            raise BackendUnavailable(f"the TensorRT engine admits at most {MAX_ROWS} cache rows, not {rows}")
        return super().load(artifact, rows, device or "cuda")
