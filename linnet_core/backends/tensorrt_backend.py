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
from typing import Any

import torch

from ..errors import BackendUnavailable
from ..runtime.session import Session
from .artifact import read_info
from .ort_backend import OnnxRuntimeBackend, import_ort

GPU_HINT = "pip install 'linnet[gpu]' (onnxruntime-gpu and tensorrt) on a machine with an NVIDIA GPU"
MAX_ROWS = 64  # the largest batch of cache rows the engine's optimisation profile admits


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

    def check_available(self, dtype: str) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable("TensorRT needs an NVIDIA GPU, and none is visible here", hint=GPU_HINT)
        _tensorrt_version()
        if "TensorrtExecutionProvider" not in import_ort().get_available_providers():
            raise BackendUnavailable("this ONNX Runtime has no TensorRT execution provider", hint=GPU_HINT)
        super().check_available(dtype)

    def toolchain(self) -> dict[str, str]:
        return {**super().toolchain(), "tensorrt": _tensorrt_version(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none"}

    def providers(self) -> list[str]:
        return ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]

    def provider_options(self, artifact: Path) -> list[dict[str, Any]]:
        info = read_info(artifact)
        c, n = info["cache"], info["cache_len"]
        trt_dir = artifact / "tensorrt"

        def shapes(rows: int, b: int, t: int) -> str:
            cache = f"{rows}x{c['kv_heads']}x{n}x{c['head_dim']}"
            dims = [f"ids:{b}x{t}", f"start:{b}", f"slots:{b}", "kv_len:1", "logits_from:1"]
            dims += [f"{kind}_cache.{i}:{cache}" for kind in ("k", "v") for i in range(c["layers"])]
            return ",".join(dims)

        trt = {
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": str(trt_dir),
            "trt_timing_cache_enable": "True",
            "trt_timing_cache_path": str(trt_dir),
            "trt_fp16_enable": str(info["dtype"] == "float16"),
            "trt_bf16_enable": str(info["dtype"] == "bfloat16"),
            "trt_profile_min_shapes": shapes(1, 1, 1),
            "trt_profile_opt_shapes": shapes(1, 1, 1),
            "trt_profile_max_shapes": shapes(MAX_ROWS, MAX_ROWS, n),
        }
        return [trt, {}, {}]

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
