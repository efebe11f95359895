"""The machine under the numbers: its memory bandwidth (for the decode roofline) and its environment."""

from __future__ import annotations

import importlib.metadata
import platform
import time
from pathlib import Path

from ..dtypes import FORMATS, compute_dtype
from ..models import build_graph
from ..models.spec import ModelSpec

VERSIONED = ("linnet", "torch", "transformers", "jax", "onnxruntime", "onnxruntime-gpu", "tensorrt",
             "llama-cpp-python", "gguf", "vllm", "sglang")


# Datasheet memory bandwidth of common GPUs (bytes/s), matched against the device name: the
# roofline people quote. The measured copy above is what the bench divides by.
NOMINAL_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                     ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
                     ("L40S", 864e9), ("L4", 300e9), ("RTX 4090", 1.008e12), ("A10G", 600e9))


def nominal_bandwidth(gpu_name: str) -> float | None:
    """The datasheet bandwidth of `gpu_name` (as torch names it), None for a GPU not in the table."""
    return next((bw for key, bw in NOMINAL_BANDWIDTH if key in gpu_name), None)


def stream_bandwidth(device: str, mib: int = 1024, repeats: int = 10, threads: int | None = None) -> float:
    """Bytes/s the device reads from its memory, STREAM-style: a reduction over a buffer far larger
    than any cache, on `threads` threads (default: torch's, which every side is given), best of
    `repeats` (on a GPU, a device-to-device copy, counted as read + write)."""
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.rand(mib * 1024 * 1024 // 4, device=device)
        b = torch.empty_like(a) if device == "cuda" else None

        def once() -> float:
            t = time.perf_counter()
            if device == "cuda":
                b.copy_(a)
                torch.cuda.synchronize()
            else:
                a.sum()
            return time.perf_counter() - t

        once()
        best = min(once() for _ in range(repeats))
        return a.nbytes * (2 if device == "cuda" else 1) / best
    finally:
        torch.set_num_threads(previous)


def decode_bytes_per_step(spec: ModelSpec, dtype: str, mean_position: float, batch: int) -> float:
    """Bytes one decode step must read: every weight except the embedding table (a gather reads one
    row; a tied head is read in full as the output projection) in the format `dtype` stores it
    (quantized blocks included), and each row's KV cache so far in the compute dtype. Of a mixture
    of experts, only the experts the step's rows choose (params.read_shares)."""
    from ..params import read_shares  # imports torch: not at start-up
    from ..quant import param_formats  # imports torch: not at start-up

    graph = build_graph(spec)
    formats = param_formats(graph, dtype)
    shares = read_shares(graph, batch)
    weights = 0.0
    for full, p, _ in graph.all_params():
        if full != "token_embd.weight":
            n = 1
            for d in p.shape:
                n *= d
            weights += FORMATS[formats[full]].nbytes(n) * shares[full]
    kv = FORMATS[compute_dtype(dtype)].nbytes(spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim)
    return weights + kv * mean_position * batch


def peak_rss(pid: int | str = "self") -> int | None:
    """A process's own high-water RSS (VmHWM), None where /proc is not there. Not getrusage's
    ru_maxrss: Linux carries a parent's peak across fork and exec into its children."""
    from ..memory import proc_kib  # imports torch: not at start-up

    return proc_kib(f"/proc/{pid}/status", "VmHWM")


def tree_peak_rss(pid: int) -> int | None:
    """Peak RSS of a process and its descendants, summed (a bound: their peaks need not coincide).
    Triton runs a Python model in a stub process beneath the server."""
    def children(p: int) -> list[int]:
        out = []
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
        return out

    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += peak_rss(p) or 0
        todo += children(p)
    return total or None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    import torch

    from ..backends.cpu.build import describe as kernel_level  # imports torch: not at start-up

    env = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),  # a --baseline is compared on the machine it came from
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cpu_kernels": kernel_level(),  # the ISA level of Linnet's CPU kernels: every figure names its machine
        "threads": torch.get_num_threads(),
        "device": device,
        "versions": {},
    }
    for dist in VERSIONED:
        try:
            env["versions"][dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["gpu_nominal_bandwidth_bytes_s"] = nominal_bandwidth(env["gpu"])
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - no NVML bindings: the driver is left out
            pass
    return env


def kernels_note(env: dict) -> str:
    """", kernels AVX2 + AVX-VNNI (avx2-vnni)": which build of Linnet's CPU kernels ran (older records lack it)."""
    return f", kernels {env['cpu_kernels']}" if env.get("cpu_kernels") else ""


def describe(env: dict) -> str:
    """One line: the hardware, then the versions that matter."""
    where = env.get("gpu") or f"{env['cpu']}, {env['threads']} threads{kernels_note(env)}"
    names = {"linnet": "Linnet", "torch": "PyTorch", "transformers": "transformers", "jax": "JAX",
             "onnxruntime": "ONNX Runtime", "onnxruntime-gpu": "ONNX Runtime", "tensorrt": "TensorRT",
             "llama-cpp-python": "llama-cpp-python", "vllm": "vLLM", "sglang": "SGLang"}
    versions = ", ".join(f"{names[k]} {v}" for k, v in env["versions"].items() if k in names)
    driver = f", driver {env['driver']}" if env.get("driver") else ""
    return f"{where} · {versions}, Python {env['python']}{driver}"
