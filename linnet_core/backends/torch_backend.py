"""Backend `torch` ("generated PyTorch"): the emitted module, run eagerly over a static KV cache.

The artifact holds `model.py` (from torch_emit, in the ragged step form: prefill, decode and the
serving engine's mixed steps are each one call), `weights.safetensors` (prepared weights in the
compile dtype, fused as the passes decided), `graph.json` and `artifact.json`. Loading maps the
weights from disk without copying them when they are already in the right dtype and device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .. import params as prepared
from ..dtypes import FORMATS, compute_dtype, narrow_kv_cache_dtype, torch_dtype
from ..errors import BackendUnavailable
from ..ir.graph import Graph
from ..quant import dequantize
from ..runtime.ragged import RaggedLayout
from ..runtime.session import Session
from .artifact import WEIGHTS_FILE, import_generated, load_prepared_weights, read_info
from .base import Backend
from .cpu import extension as cpu_kernels
from .cpu.linears import DecodeLinear, Kernels, PackedFloatLinear, active, linear_kernel, pack_linear_weights
from .cpu.step_kernels import add_step_kernels
from .torch_emit import emit

# Linear weights the eager backend repacks at load: float32 for Linnet's kernel where it runs
# (csrc/gemv.cpp's 8-row layout, a plain read's speed), for oneDNN elsewhere (35 vs 16 GB/s for
# F.linear here). bfloat16 stays mapped where the ISA multiplies bf16, served by Linnet's own GEMV
# (~41 GB/s, no copy; packing 8 GB for oneDNN took ~3.5 s at every load for 14%); elsewhere it is
# repacked as float16 is, and F.linear serves it where Linnet's kernels do not build.
PACKED_AT_LOAD = ("float32",)


def kernels_at_load(dtype: str) -> bool:
    """Whether a CPU session wraps its float linear weights in kernels at load (a copy only where packed)."""
    return compute_dtype(dtype) in PACKED_AT_LOAD or linear_kernel(torch_dtype(dtype)) in (DecodeLinear, PackedFloatLinear)


def cpu_weights(weights: dict, info: dict, eager: bool) -> list:
    """A CPU session's weights wrapped in this CPU's kernels (in place), and the linear and
    quantized weights' kernels in handle order; the step's own kernels (StepKernels) beside them.
    Token tables (read by gathers) are mapped in 4 KiB pages, the rest in 2 MiB ones."""
    group, heads = weights["global"], info["linear_weights"]["global"]
    tables = [name for name in info.get("gathered_weights", [])  # a table tied to the head is read whole
              if not any(group[name] is group[head] for head in heads)]
    kernels = pack_linear_weights(weights, info["linear_weights"], pack=kernels_at_load(info["dtype"]))
    in_small_pages = getattr(weights, "in_small_pages", lambda name: None)  # a plain dict: nothing mapped
    for name in tables:
        in_small_pages(name)
    add_step_kernels(weights, cpu_kernels.extension(), torch_dtype(info["dtype"]), info["cache"]["head_dim"], eager)
    return kernels


class BlockLinear:
    """GGUF blocks on a GPU, compressed as stored: each call dequantizes the weight (a transient
    float32 [N, K], exactly quant.dequantize's numbers) for one matmul; never a float copy held
    beside the blocks."""

    def __init__(self, blocks: torch.Tensor, fmt: str):
        self.blocks, self.fmt = blocks, fmt  # [N, nb * block_bytes] uint8

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, dequantize(self.blocks, self.fmt), bias)


class BlockTable(BlockLinear):
    """A token table in GGUF blocks on a GPU: only the rows gathered are dequantized."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.blocks[ids], self.fmt)  # [..., K] float32


def device_block_weights(weights, names: dict[str, list[str]]) -> None:
    """Wrap, in place, the block-quantized weights of a GPU session: linear ones in BlockLinear,
    a token table in BlockTable (the generated `linear` and `embedding` call them)."""
    groups = [(weights["global"], names["global"], "")]
    groups += [(layer, names["block"], f"blk.{i}.") for i, layer in enumerate(weights["layers"])]
    stacks = names.get("experts", {})
    for group, linear_names, prefix in groups:
        for name in group:
            fmt = weights.format_of(prefix + name)
            if fmt is not None and prefix and name in stacks:  # one per expert: a step runs the chosen ones
                group[name] = [BlockLinear(part, fmt) for part in group[name].chunk(stacks[name], dim=0)]
            elif fmt is not None:
                group[name] = (BlockLinear if name in linear_names else BlockTable)(group[name], fmt)


def session_weights(weights, info: dict, device: str, eager: bool) -> Kernels:
    """Wrap a session's weights for its device, in place: this CPU's kernels (returned in handle
    order), or on a GPU the block-quantized weights' BlockLinear / BlockTable. `eager`: the step
    runs uncompiled (the small ops' kernels help there; a compiler fuses those itself)."""
    if device == "cpu":
        return cpu_weights(weights, info, eager)
    device_block_weights(weights, info["linear_weights"])
    return Kernels([])  # none: the compiled step's `active(...)` then activates nothing


def check_quantized(dtype: str, device: str) -> None:
    """Block-quantized weights run through Linnet's CPU kernels on a CPU (BlockLinear on a GPU):
    refuse, in one line, where those kernels do not build."""
    if not FORMATS[dtype].quantized or device != "cpu":
        return
    if cpu_kernels.extension() is None:
        raise BackendUnavailable(f"{dtype} weights need Linnet's CPU kernels, and here {cpu_kernels.why_not()}",
                                 hint="choose --dtype bf16 or float32")


class TorchSession(Session):
    """The generated step over a static KV cache, in whichever step form the module was emitted."""

    def __init__(self, module, weights: dict[str, Any], info: dict, rows: int, device: str, backend: str,
                 kernels: Kernels | None = None):
        self.module, self.weights, self.backend = module, weights, backend
        # C++ operators that take kernels by handle (the experts') find this session's while a step runs
        self.kernels = kernels if kernels is not None else Kernels([])
        self.dtype, self.cache_len, self.vocab_size, self.rows = info["dtype"], info["cache_len"], info["vocab_size"], rows
        self.ragged = info["step"] == "ragged"
        self.device = torch.device(device)
        c = info["cache"]
        shape = (c["layers"], rows, c["kv_heads"], self.cache_len, c["head_dim"])
        self.k_cache = torch.zeros(shape, dtype=torch_dtype(narrow_kv_cache_dtype(self.dtype)), device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        # the step's activations, where the cache is held narrower (the generated setup's `dtype`)
        weights["global"]["compute_dtype"] = torch_dtype(self.dtype)
        self.step_fn = module.step

    def _run(self, ids: Sequence[Sequence[int]], start: Sequence[int], slots: Sequence[int], all_logits: bool):
        kv_len = max(s + len(row) for s, row in zip(start, ids))
        with torch.inference_mode():
            ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [B, T]
            start_t = torch.tensor(start, dtype=torch.int64, device=self.device)  # [B]
            slots_t = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [B]
            last = torch.full((len(ids),), len(ids[0]) - 1, dtype=torch.int64, device=self.device)  # [B]
            with active(self.kernels):
                return self.step_fn(self.weights, ids_t, start_t, slots_t, last, kv_len, self.k_cache, self.v_cache,
                                    all_logits)

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        for cache in (self.k_cache, self.v_cache):  # [layers, rows, kv_heads, cache_len, head_dim]
            cache[:, dst, :, :n].copy_(cache[:, src, :, :n])

    def _run_ragged(self, layout: RaggedLayout):
        """The step as one ragged call: linear layers over all its tokens at once."""
        feeds = {}
        for name, (values, shape) in layout.inputs().items():  # the attention spans stay ints
            feeds[name] = values[0] if name.endswith("kv_len") else \
                torch.tensor(values, dtype=torch.int64, device=self.device).reshape(shape)
        with torch.inference_mode(), active(self.kernels):
            return self.step_fn(self.weights, **feeds, k_cache=self.k_cache, v_cache=self.v_cache)


class TorchBackend(Backend):
    stack = "PyTorch"
    name = "torch"
    title = "generated PyTorch"

    ragged = True  # the serving engine's mixed steps run as one call
    int8_activations_on_cpu = True  # Linnet's CPU kernels (quant_linear.cpp); BlockLinear on a GPU dequantizes
    artifact_format = "11"

    def toolchain(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def kv_cache_dtype(self, dtype: str) -> str:
        return narrow_kv_cache_dtype(dtype)

    def check_available(self, dtype: str) -> None:
        if dtype not in FORMATS:
            raise BackendUnavailable(f"the {self.name} backend has no dtype '{dtype}'")
        if FORMATS[dtype].quantized:
            check_quantized(dtype, self.default_device())

    def emit(self, graph: Graph, dtype: str, cache_len: int, out: Path) -> None:
        (out / "model.py").write_text(emit(graph))

    def artifact_extra(self, graph: Graph) -> dict[str, Any]:
        return {"linear_weights": prepared.linear_weights(graph), "gathered_weights": prepared.gathered_weights(graph)}

    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        info = read_info(artifact)
        device = device or self.default_device()
        self.check_device(device)
        check_quantized(info["dtype"], device)
        module = import_generated(artifact / "model.py", "linnet_generated")
        weights = load_prepared_weights(artifact / WEIGHTS_FILE, device)
        kernels = session_weights(weights, info, device, eager=True)
        return TorchSession(module, weights, info, rows, device, self.name, kernels)
