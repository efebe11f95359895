"""Backend `onnxruntime`: the emitted ONNX graph on ONNX Runtime (CUDA provider on a GPU, else CPU).

Every tensor a step touches lives in torch tensors on the session's device and is bound to ONNX
Runtime by pointer (I/O binding): the KV cache outputs are bound to the input buffers, so the
cache never moves or copies between steps, and only the next tokens come back to the host.
The graph takes ragged steps (decode rows and prompt chunks in one call: see onnx_emit).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Sequence

import torch

from ..dtypes import FORMATS, compute_dtype, onnx_elem_of_torch, torch_dtype
from ..errors import BackendUnavailable
from ..ir.graph import Graph
from ..runtime.ragged import RaggedLayout
from ..runtime.session import Session
from ..weight_store import Placer
from ..weights import Checkpoint
from .artifact import read_info
from .base import Backend
from .onnx_emit import IR_VERSION, OPSET, build_onnx, require_onnx, write_onnx

INSTALL_HINT = "pip install 'linnet[onnx]'"


def import_ort():
    try:
        import onnxruntime
    except ImportError:
        raise BackendUnavailable("ONNX Runtime is not installed", hint=INSTALL_HINT) from None
    return onnxruntime


def _missing_kernel(error: Exception, provider: str, dtype: str) -> BackendUnavailable | None:
    """ONNX Runtime's 'no implementation for OP' error, as one line that names op and dtype."""
    m = re.search(r"implementation for (\w+)\((\d+)\)", str(error))
    if not m:
        return None
    return BackendUnavailable(
        f"ONNX Runtime's {provider} has no {dtype} kernel for {m.group(1)} (opset {m.group(2)}); "
        f"Linnet does not run another dtype in its place",
        hint="choose another --dtype (float32 runs everywhere), or run on a GPU",
    )


@functools.lru_cache(maxsize=None)
def _probe_dtype(providers: tuple[str, ...], dtype: str) -> str | None:
    """Try a one-MatMul model in `dtype` on `providers`; the reason it fails, or None."""
    from onnx import helper

    ort = import_ort()
    elem = FORMATS[dtype].onnx
    node = helper.make_node("MatMul", ["a", "b"], ["c"])
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("a", elem, [2, 2]),
                                                helper.make_tensor_value_info("b", elem, [2, 2])],
                              [helper.make_tensor_value_info("c", elem, [2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    try:
        ort.InferenceSession(model.SerializeToString(), providers=list(providers))
    except Exception as e:  # ONNX Runtime raises its own exception types
        err = _missing_kernel(e, providers[0], dtype)
        return err.message if err else str(e).splitlines()[0]
    return None


def cuda_provider_options(device_index: int, stream: int) -> dict[str, str]:
    """ONNX Runtime's CUDA provider on torch's device and stream: what torch wrote into a bound
    buffer (the zeroed cache, the step's inputs) is ordered before the step reads it, and the
    arena grows by what is asked rather than in doubling chunks."""
    return {"device_id": str(device_index), "user_compute_stream": str(stream),
            "arena_extend_strategy": "kSameAsRequested"}


def torch_cuda_place() -> tuple[int, int]:
    """(device index, raw stream handle) of torch's current CUDA stream."""
    return torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream


def _bind(binding, bind_fn, name: str, t: torch.Tensor) -> None:
    dev = t.device
    bind_fn(name, dev.type, dev.index or 0, onnx_elem_of_torch(t.dtype), list(t.shape), t.data_ptr())


class OrtSession(Session):
    def __init__(self, sess, info: dict, rows: int, device: str, backend: str):
        self.sess, self.backend, self.rows = sess, backend, rows
        self.ragged = info["step"] == "ragged"
        self.dtype, self.cache_len, self.vocab_size = info["dtype"], info["cache_len"], info["vocab_size"]
        self.device = torch.device(device)
        c = info["cache"]
        shape = (rows, c["kv_heads"], self.cache_len, c["head_dim"])
        tdt = torch_dtype(self.dtype)
        # Zeroed, not empty: masked positions still pass through the value MatMul (0 x NaN = NaN).
        self.caches = {f"{kind}_cache.{i}": torch.zeros(shape, dtype=tdt, device=self.device)
                       for kind in ("k", "v") for i in range(c["layers"])}

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        for cache in self.caches.values():  # [rows, kv_heads, cache_len, head_dim], bound in place
            cache[dst, :, :n].copy_(cache[src, :, :n])

    def _run(self, ids: Sequence[Sequence[int]], start: Sequence[int], slots: Sequence[int], all_logits: bool):
        B, T = len(ids), len(ids[0])
        feeds = {
            "ids": torch.tensor(ids, dtype=torch.int64),  # [B, T]
            "start": torch.tensor(start, dtype=torch.int64),  # [B]
            "slots": torch.tensor(slots, dtype=torch.int64),  # [B]
            "kv_len": torch.tensor([max(s + T for s in start)], dtype=torch.int64),
            "logits_from": torch.tensor([0 if all_logits else T - 1], dtype=torch.int64),
        }
        return self._call(feeds, B, T if all_logits else 1)

    def _run_ragged(self, layout: RaggedLayout):
        feeds = {name: torch.tensor(values, dtype=torch.int64).reshape(shape)
                 for name, (values, shape) in layout.inputs().items()}
        return self._call(feeds, len(layout.logits_index))

    def _call(self, feeds: dict[str, torch.Tensor], rows: int, per_row: int = 1):
        """Bind and run: (next_token [rows], logits [rows, per_row, V]); ragged steps have one row
        per logits_index entry."""
        dev = self.device
        next_token = torch.empty(rows, dtype=torch.int64, device=dev)  # [rows]
        logits = torch.empty(rows, per_row, self.vocab_size, dtype=torch_dtype(self.dtype), device=dev)
        feeds = {name: t.to(dev) for name, t in feeds.items()}  # held until the run ends: bound by pointer
        io = self.sess.io_binding()
        for name, t in feeds.items():
            _bind(io, io.bind_input, name, t)
        for name, t in self.caches.items():  # in place: the output is the input's buffer
            _bind(io, io.bind_input, name, t)
            _bind(io, io.bind_output, name.replace("_cache.", "_cache_out."), t)
        _bind(io, io.bind_output, "next_token", next_token)
        _bind(io, io.bind_output, "logits", logits)
        self.sess.run_with_iobinding(io)
        return next_token, logits


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    stack = "ONNX Runtime and TensorRT"
    title = "ONNX Runtime"
    artifact_format = "4"
    ragged = True  # the graph takes mixed steps (TensorRT's builder keeps the dense [B, T] form)
    # MatMulNBits at accuracy level 4 (onnx_emit.NBITS_ACCURACY): the int8 kernels that make it fast
    # on CPU round activations per block, as llama.cpp does; the CUDA provider's kernel dequantizes.
    int8_activations_on_cpu = True
    copies_of_tied = 2  # ONNX initializers: the embedding, and the head transposed for MatMul

    def providers(self, device: str) -> list[str]:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]

    def provider_options(self, artifact: Path, device: str) -> list[dict[str, str]]:
        if device != "cuda":
            return [{}]
        return [cuda_provider_options(*torch_cuda_place()), {}]

    def weight_copies(self, dtype: str, device: str) -> float:
        # The CPU provider has no float16 MatMul: it casts those weights to float32 at load and
        # keeps both (measured: 2x the float16 bytes).
        return 2.0 if device == "cpu" and dtype == "float16" else 1.0

    def check_device(self, device: str) -> None:
        super().check_device(device)
        if device == "cuda" and "CUDAExecutionProvider" not in import_ort().get_available_providers():
            raise BackendUnavailable("this ONNX Runtime has no CUDA execution provider",
                                     hint="pip install onnxruntime-gpu in place of onnxruntime")

    def toolchain(self) -> dict[str, str]:
        import onnx

        return {"onnx": onnx.__version__, "onnxruntime": import_ort().__version__}

    def check_available(self, dtype: str) -> None:
        require_onnx()
        if dtype not in FORMATS:
            raise BackendUnavailable(f"the {self.name} backend has no dtype '{dtype}'")
        reason = _probe_dtype(tuple(self.providers(self.default_device())), compute_dtype(dtype))
        if reason:
            raise BackendUnavailable(reason, hint="choose another --dtype (float32 runs everywhere), or run on a GPU")

    def emit(self, graph: Graph, dtype: str, cache_len: int, out: Path):
        model = build_onnx(graph, dtype, cache_len)
        # The weights are the model's external data: the model file is written once they are.
        return lambda ckpt, place: write_onnx(model, graph, ckpt, dtype, cache_len, out, place=place)

    def write_weights(self, graph: Graph, ckpt: Checkpoint, dtype: str, out: Path, emitted, place: Placer) -> None:
        emitted(ckpt, place)

    def session_options(self, device: str, dtype: str, rows: int = 1):
        ort = import_ort()
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = torch.get_num_threads()
        so.log_severity_level = 3  # errors only: its warnings are not the user's business
        if device == "cpu" and dtype == "float32" and rows == 1:
            # ORT maps float32 external data; prepacking would copy every MatMul weight into MLAS's
            # panels (a 4B model: 27 s and 17.5 GB of anonymous memory) for ~20% faster prefill and
            # the same one-row decode. With more rows every step is a GEMM of M >= 2, which packs the
            # whole weight again each call unpacked (8 rows, 191M, AVX2: 91 ms a step against 28 for
            # one row), so a session of several rows packs once. float16 is cast to float32 at load
            # anyway, and packed runs 1.3x faster; MatMulNBits packs its blocks.
            so.add_session_config_entry("session.disable_prepacking", "1")
        return so

    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        ort = import_ort()
        device = device or self.default_device()
        self.check_device(device)
        info = read_info(artifact)
        providers = self.providers(device)
        try:
            sess = ort.InferenceSession(str(artifact / "model.onnx"), self.session_options(device, info["dtype"], rows),
                                        providers=providers, provider_options=self.provider_options(artifact, device))
        except Exception as e:
            err = _missing_kernel(e, providers[0], info["dtype"])
            if err:
                raise err from None
            raise BackendUnavailable(f"ONNX Runtime could not load {artifact.name}: {str(e).splitlines()[0]}") from None
        return OrtSession(sess, info, rows, device, self.name)
