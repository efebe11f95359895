"""Block-quantized weights in GGUF's exact layouts (q8_0, q4_0), and which weights a model stores so.

A block is 32 consecutive weights of a row: an f16 scale d, then 32 int8 (q8_0: w = d * q) or 16
bytes of 4-bit values (q4_0: byte j holds weights j and j + 16 in its low and high nibble, w =
d * (q - 8)). `quantize` gives the same bytes as the `gguf` package's quantizer (ggml's reference
rounding), so an artifact and its GGUF export hold identical weights and llama.cpp computes on the
very numbers Linnet does. Tensors are [rows, K] in, [rows, K / 32 * block_bytes] uint8 out.
"""

from __future__ import annotations

import torch

from .dtypes import FORMATS, compute_dtype
from .ir.graph import Graph
from .ir.ops import matrix_inputs

BLOCK = 32
HEAD_FORMAT = "q8_0"  # the output head (and a table tied to it): llama.cpp keeps it wider too (q6_K for q4_0)


def roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as ggml's roundf and the gguf package's np_roundf."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded as int8 blocks of 32 with a float32 scale amax / 127 (llama.cpp's q8_0
    activations; ONNX Runtime's MatMulNBits at accuracy level 4; Linnet's CPU kernels): the value
    each such kernel multiplies."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)  # [..., K / 32, 32]
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return (roundf(blocks * inv) * d).reshape(x.shape).to(x.dtype)


def quantize(w: torch.Tensor, fmt: str, chunk: int = 1 << 22) -> torch.Tensor:
    """w [..., K] (K a multiple of 32) -> uint8 blocks [..., K / 32 * block_bytes] of `fmt`, made
    `chunk` weights at a time so the float32 temporaries stay small beside a large weight."""
    *lead, k = w.shape
    flat = w.reshape(-1, BLOCK)  # [nb, 32]
    step = max(1, chunk // BLOCK)
    out = torch.cat([_quantize_blocks(flat[i:i + step].float(), fmt) for i in range(0, flat.shape[0], step)])
    return out.reshape(*lead, k // BLOCK * FORMATS[fmt].block_bytes)


def _quantize_blocks(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 [nb, 32] -> uint8 [nb, block_bytes]."""
    if fmt == "q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127  # [nb, 1]
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        qs = roundf(blocks * inv).to(torch.int8).view(torch.uint8)  # [nb, 32]
    elif fmt == "q4_0":
        imax = blocks.abs().argmax(dim=1, keepdim=True)
        d = blocks.gather(1, imax) / -8  # [nb, 1]: the largest magnitude maps to -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)  # [nb, 32]
        qs = q[:, :16] | (q[:, 16:] << 4)  # [nb, 16]
    else:
        raise ValueError(f"no block quantizer for '{fmt}'")
    scale = d.to(torch.float16).view(torch.uint8)  # [nb, 2]
    return torch.cat([scale, qs], dim=1)


def dequantize(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 blocks [..., nb * block_bytes] of `fmt` -> float32 weights [..., nb * 32]."""
    *lead, nbytes = q.shape
    blocks = q.reshape(-1, FORMATS[fmt].block_bytes)  # [nb, bb]
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [nb, 1]
    if fmt == "q8_0":
        w = blocks[:, 2:].contiguous().view(torch.int8).float()  # [nb, 32]
    elif fmt == "q4_0":
        packed = blocks[:, 2:]  # [nb, 16]
        w = torch.cat([packed & 0x0F, packed >> 4], dim=1).float() - 8  # [nb, 32]
    else:
        raise ValueError(f"no block dequantizer for '{fmt}'")
    return (w * d).reshape(*lead, nbytes // FORMATS[fmt].block_bytes * BLOCK)


def nbits_layout(q: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks [N, nb * block_bytes] -> (values uint8 [N, nb, 32 * bits / 8], scales float32
    [N, nb]): ONNX Runtime's MatMulNBits layout, also what the XLA graphs dequantize. Values are
    unsigned with the default zero point 2^(bits-1) (q8_0's int8 + 128; q4_0's q as it is), in order
    (q4_0: byte j holds weights 2j and 2j + 1), and the f16 scales widen exactly: the same weights."""
    n, nbytes = q.shape
    blocks = q.reshape(n, -1, FORMATS[fmt].block_bytes)  # [N, nb, bb]
    scales = blocks[..., :2].contiguous().view(torch.float16).float().squeeze(-1)  # [N, nb]
    if fmt == "q8_0":
        values = blocks[..., 2:] ^ 0x80  # int8 two's complement + 128
    elif fmt == "q4_0":
        packed = blocks[..., 2:]  # [N, nb, 16]: weights j (low nibble) and j + 16 (high)
        w = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [N, nb, 32] in order
        values = w[..., 0::2] | (w[..., 1::2] << 4)  # [N, nb, 16]
    else:
        raise ValueError(f"no MatMulNBits layout for '{fmt}'")
    return values.contiguous(), scales


NBITS = {"q8_0": 8, "q4_0": 4}  # bits per weight of each block format in the nbits layout


def nbits_shapes(rows: int, k: int, fmt: str) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """The shapes nbits_layout gives a [rows, K] weight of `fmt`: (values, scales)."""
    return (rows, k // BLOCK, BLOCK * NBITS[fmt] // 8), (rows, k // BLOCK)


def stored_shape(shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """The shape a [rows, K] weight has in a file: as it is, or its blocks' bytes as uint8."""
    if not FORMATS[fmt].quantized:
        return tuple(shape)
    return (*shape[:-1], shape[-1] // BLOCK * FORMATS[fmt].block_bytes)


def param_formats(graph: Graph, fmt: str) -> dict[str, str]:
    """Each param's storage format under `--dtype fmt` (full names, as graph.all_params gives them).

    A quantized choice applies to the weights of linear ops and the token table, as llama.cpp's
    quantizer does; the output head (and a table tied to it) is HEAD_FORMAT; a weight whose input
    size is not a whole number of blocks, norms and biases stay in the compute dtype."""
    compute = compute_dtype(fmt)
    out = {full: compute for full, _, _ in graph.all_params()}
    if not FORMATS[fmt].quantized:
        return out
    block_linear = matrix_inputs(graph.block.nodes)
    head = matrix_inputs(graph.epilogue)
    global_linear = matrix_inputs(graph.prologue + graph.epilogue) | {
        n.inputs[1] for n in graph.prologue if n.op == "embedding"}
    sources: dict[tuple, list[str]] = {}
    for full, p, layer in graph.all_params():
        local = full if layer is None else full.split(".", 2)[2]
        if local in (global_linear if layer is None else block_linear) and len(p.shape) == 2 \
                and p.shape[-1] % BLOCK == 0:
            out[full] = HEAD_FORMAT if local in head else fmt
        sources.setdefault(tuple(p.sources(layer)), []).append(full)
    for names in sources.values():  # a table tied to the head is stored once, as the head is
        if len(names) > 1 and any(out[n] == HEAD_FORMAT for n in names):
            for n in names:
                out[n] = HEAD_FORMAT if FORMATS[out[n]].quantized else out[n]
    return out


def kept_wide(graph: Graph, fmt: str) -> list[str]:
    """Weights of linear ops that stay in the compute dtype under a quantized `fmt`: their input
    size is not a multiple of the block (the compile summary names them)."""
    if not FORMATS[fmt].quantized:
        return []
    formats = param_formats(graph, fmt)
    names = set()
    for full, p, layer in graph.all_params():
        local = full if layer is None else full.split(".", 2)[2]
        nodes = graph.block.nodes if layer is not None else graph.prologue + graph.epilogue
        if local in matrix_inputs(nodes) and not FORMATS[formats[full]].quantized:
            names.add(local)
    return sorted(names)


def summary(graph: Graph, fmt: str) -> str | None:
    """One line on how a quantized choice stores the weights (None for a float one), naming any
    linear weight kept in the compute dtype for an input size that is not a whole number of blocks."""
    if not FORMATS[fmt].quantized:
        return None
    quantized = sum(FORMATS[f].quantized for f in param_formats(graph, fmt).values())
    routers = any(n.op == "route" for n in graph.block.nodes)  # kept wide: see ops.matrix_inputs
    line = (f"weights: {quantized} tensors in {fmt} blocks (the output head in {HEAD_FORMAT}), "
            f"{'norms, biases and routers' if routers else 'norms and biases'} in {compute_dtype(fmt)}")
    wide = kept_wide(graph, fmt)
    if wide:
        line += f"; kept in {compute_dtype(fmt)}, input size not a multiple of {BLOCK}: {', '.join(wide)}"
    return line
