"""Decode speed and load time: Linnet's backends against `transformers` eager, side by side.

    python bench/decode_speed.py                 # the issue's 191M Qwen3, 128-token prompt, 64 new
    python bench/decode_speed.py --layers 2 --repeats 2 --new 16   # a quick look

Both sides run the same random float32 checkpoint (written by transformers itself), in one
process, interleaved run by run so a drifting machine favours neither; the speed-up is a ratio
of medians from this run. Load times are measured in fresh processes (warm page cache, warm
Linnet artifact; "ready" includes the first prefill and decode step, so compiled backends
pay for loading their compiled code). Compile times are cold: the script uses a fresh artifact
cache. The memory bandwidth is measured three ways: a plain streaming read (what
the machine can do), and float32 GEMV through F.linear (MKL) and through oneDNN's packed
weights (what the kernels reach); decode is
reported as the fraction of the streaming-read roofline it reaches (bytes read per token x
tokens/s / bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402  (the comparator beside this script)

HERE = Path(__file__).resolve().parent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_checkpoint(folder: Path, args) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (folder / "config.json").is_file():
        return folder
    config = Qwen3Config(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    return folder


def stream_read_bandwidth(mib: int = 1024, repeats: int = 10) -> float:
    """GB/s reading a buffer far larger than the caches, on all threads (torch sum; best of N)."""
    a = torch.rand(mib * 1024 * 1024 // 4)
    a.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return a.nbytes / min(times) / 1e9


def gemv_bandwidth(packed: bool, total_mib: int = 512, repeats: int = 5) -> float:
    """GB/s of float32 matrix-vector products over 32 distinct 4096x1024 weights (more than L3).

    packed=False is F.linear (MKL here); packed=True is oneDNN over weights reordered at load,
    the kernel Linnet's CPU sessions use.
    """
    from linnet_core.backends.cpu_kernels import pack

    weights = [torch.randn(4096, 1024) for _ in range(total_mib // 16)]
    if packed:
        weights = [pack(w) for w in weights]
    x = torch.randn(1, 1024)

    def once():
        for w in weights:
            if packed:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            else:
                torch.nn.functional.linear(x, w)

    once()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return len(weights) * 4096 * 1024 * 4 / min(times) / 1e9


def hf_decode(model, prompt: list[int], new: int) -> tuple[float, float]:
    """(time to first token s, decode tok/s) for transformers eager, greedy, with its KV cache."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True)
        token = out.logits[0, -1].argmax()
        ttft = time.perf_counter() - t0
        past = out.past_key_values
        t1 = time.perf_counter()
        for _ in range(new - 1):
            out = model(token.view(1, 1), past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[0, -1].argmax()
        return ttft, (new - 1) / (time.perf_counter() - t1)


def hf_compiled_decode(model, cache, prompt: list[int], new: int) -> tuple[float, float]:
    """transformers with its forward under torch.compile and a static cache, greedy, via generate()."""
    ids = torch.tensor([prompt])

    def generate(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            cache.reset()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache)
        return time.perf_counter() - t

    ttft = generate(1)
    return ttft, (new - 1) / (generate(new) - ttft)


def linnet_decode(session, prompt: list[int], new: int) -> tuple[float, float]:
    from linnet_core.runtime.generate import Generation

    gen = Generation(session, prompt, new)
    assert len(list(gen)) == new
    return gen.stats.ttft_s, gen.stats.decode_tok_s


LLAMACPP = "llama.cpp f32 (GGUF of the same weights)"
HF_COMPILED = "transformers, torch.compile + static cache"
LOAD_SNIPPETS = {
    "llama.cpp": (
        "import sys, time; sys.path.insert(0, {here!r}); import llamacpp; t=time.perf_counter();"
        "llm=llamacpp.load({path!r}, {cache_len}); print(time.perf_counter()-t)"
    ),
    "transformers": (
        "import time, torch; from transformers import AutoModelForCausalLM; t=time.perf_counter();"
        "m=AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32, attn_implementation='eager');"
        "m(torch.tensor([[1, 2]])); print(time.perf_counter()-t)"
    ),
    "linnet": (
        "import time; from linnet_core.compile import load_model; t=time.perf_counter();"
        "s,c=load_model({path!r}, {backend!r}, 'float32', {cache_len}); assert c.hit, 'artifact was not cached';"
        "s.prefill([1, 2]); s.decode([3], [2], [0]); print(time.perf_counter()-t)"
    ),
}


def load_time(side: str, path: Path, cache_len: int, backend: str = "") -> float:
    code = LOAD_SNIPPETS[side].format(path=str(path), cache_len=cache_len, backend=backend, here=str(HERE))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})  # LINNET_CACHE included
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache-len", type=int, default=256)
    ap.add_argument("--backends", default="torch,inductor,onnxruntime,jax,stablehlo",
                    help="Linnet backends to run, comma-separated")
    ap.add_argument("--no-hf-compiled", dest="hf_compiled", action="store_false",
                    help="skip transformers with torch.compile and a static cache")
    ap.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="skip the llama.cpp comparator")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "linnet-bench")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "decode_speed.json")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from linnet_core.backends import get_backend
    from linnet_core.compile import compile_model, load_model
    from linnet_core.errors import LinnetError

    logging.set_verbosity_error()
    ckpt = make_checkpoint(args.workdir / f"qwen3-h{args.hidden}-l{args.layers}", args)
    weight_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    # A fresh artifact cache: compile times are cold, load times (fresh processes) are warm.
    cache_dir = args.workdir / "linnet-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    os.environ["LINNET_CACHE"] = str(cache_dir)
    backends = [b for b in args.backends.split(",") if b]
    missing, compile_s = {}, {}
    for b in backends:
        try:
            c = compile_model(ckpt, b, "float32", args.cache_len)
            compile_s[f"linnet {b}"] = c.seconds
            print(f"Linnet {b}: cold compile {c.seconds:.1f} s", file=sys.stderr)
        except LinnetError as e:
            missing[f"linnet {b}"] = e.message
    backends = [b for b in backends if b not in missing]
    print(f"checkpoint {ckpt} ({weight_bytes / 1e6:.0f} MB)", file=sys.stderr)

    stream_bw = stream_read_bandwidth()
    gemv_bw, packed_bw = gemv_bandwidth(packed=False), gemv_bandwidth(packed=True)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32000, args.prompt).tolist()

    with torch.inference_mode():  # the reference's logits after the prompt, for each side's distance
        ref_logits = hf(torch.tensor([prompt])).logits[0, -1].float().numpy()
    distance = {"transformers eager": 0.0}
    runners = {"transformers eager": lambda: hf_decode(hf, prompt, args.new)}
    if args.hf_compiled:
        from transformers import StaticCache

        hf_c = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
        hf_c.forward = torch.compile(hf_c.forward, fullgraph=True)
        static = StaticCache(config=hf_c.config, max_cache_len=args.cache_len)
        runners[HF_COMPILED] = lambda: hf_compiled_decode(hf_c, static, prompt, args.new)
        t = time.perf_counter()
        runners[HF_COMPILED]()  # the compile, timed like Linnet's
        compile_s[HF_COMPILED] = time.perf_counter() - t
        distance[HF_COMPILED] = 0.0  # the reference's own code
    sessions = {}
    for b in backends:
        sessions[f"linnet {b}"], compiled = load_model(ckpt, b, "float32", args.cache_len)
        if b == "torch":  # the same artifact with F.linear instead of oneDNN's packed weights
            sessions["linnet torch, F.linear"] = get_backend("torch").load(compiled.artifact, rows=1, pack_weights=False)
    for name, session in sessions.items():
        runners[name] = lambda session=session: linnet_decode(session, prompt, args.new)
        distance[name] = float(np.abs(session.prefill(prompt, logits="last").logits[0, -1] - ref_logits).max())
    gguf_path = None
    if args.llamacpp:
        why = llamacpp.available()
        if why:
            missing["llama.cpp"] = why
        else:
            gguf_path = llamacpp.write_gguf(ckpt, ckpt.parent / f"{ckpt.name}.f32.gguf")
            llm = llamacpp.load(gguf_path, args.cache_len)
            runners[LLAMACPP] = lambda: llamacpp.decode(llm, prompt, args.new)
            distance[LLAMACPP] = float(np.abs(llamacpp.last_logits(gguf_path, args.cache_len, prompt) - ref_logits).max())
    for fn in runners.values():  # warm-up: first-call allocations on every side
        fn()

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for r in range(args.repeats):
        order = list(runners.items())
        for name, fn in order if r % 2 == 0 else order[::-1]:
            samples[name].append(fn())
        print(f"run {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1][1]:.1f} tok/s" for k, v in samples.items()),
              file=sys.stderr)
    sessions.clear()
    runners.clear()
    hf = hf_c = llm = None  # free them before the load-time processes run

    loads: dict[str, list[float]] = {name: [] for name in samples}
    for _ in range(3):
        loads["transformers eager"].append(load_time("transformers", ckpt, args.cache_len))
        for b in backends:
            loads[f"linnet {b}"].append(load_time("linnet", ckpt, args.cache_len, b))
        if gguf_path:
            loads[LLAMACPP].append(load_time("llama.cpp", gguf_path, args.cache_len))

    # Measured again after the runs: the best of both is the machine's bandwidth (it is shared).
    stream_bw = max(stream_bw, stream_read_bandwidth())
    # Decode reads every weight once per token (the embedding table is gathered, not streamed),
    # and the KV cache up to the current position: at the mean position of the run.
    embed_bytes = 32000 * args.hidden * 4
    kv_bytes = args.layers * 2 * 8 * 128 * 4 * (args.prompt + args.new / 2)
    bytes_per_token = weight_bytes - embed_bytes + kv_bytes
    rows = {}
    for name, s in samples.items():
        tok_s = statistics.median(v[1] for v in s)
        rows[name] = {
            "decode_tok_s": tok_s,
            "ttft_ms": statistics.median(v[0] for v in s) * 1000,
            "load_s": statistics.median(loads[name]) if loads[name] else None,
            "bytes_per_token": bytes_per_token,
            "achieved_gb_s": tok_s * bytes_per_token / 1e9,
            "roofline": tok_s * bytes_per_token / (stream_bw * 1e9),
            "distance_from_reference": distance[name],
            "cold_compile_s": compile_s.get(name),
            "samples_tok_s": [v[1] for v in s],
            "samples_load_s": loads[name],
        }
    base = rows["transformers eager"]
    for row in rows.values():
        row["decode_speedup"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["load_speedup"] = base["load_s"] / row["load_s"] if row["load_s"] else None
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "model": {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate,
                  "weight_bytes": weight_bytes, "prompt": args.prompt, "new": args.new, "repeats": args.repeats},
        "bandwidth_gb_s": {"stream_read": stream_bw, "gemv_f_linear": gemv_bw, "gemv_onednn_packed": packed_bw},
        "rows": rows,
        "missing": missing,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nmemory bandwidth: {stream_bw:.1f} GB/s streaming read (all threads); float32 GEMV reaches "
          f"{gemv_bw:.1f} GB/s with F.linear (MKL), {packed_bw:.1f} GB/s with oneDNN packed weights; "
          f"decode reads {bytes_per_token / 1e6:.0f} MB per token\n")
    print("| side | decode tok/s | vs transformers | TTFT ms | cold compile s | load s (warm) | GB/s read | roofline "
          "| distance |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        load = "-" if row["load_s"] is None else f"{row['load_s']:.2f}"
        cold = "-" if row["cold_compile_s"] is None else f"{row['cold_compile_s']:.1f}"
        print(f"| {name} | {row['decode_tok_s']:.1f} | {row['decode_speedup']:.2f}x | {row['ttft_ms']:.0f} | {cold} | {load} | "
              f"{row['achieved_gb_s']:.1f} | {row['roofline']:.0%} | {row['distance_from_reference']:.1e} |")
    for b, why in missing.items():
        print(f"| {b} | missing: {why} | | | | | | | |")
    print(f"\n{result['machine']['cpu']}, {result['machine']['threads']} threads, torch {torch.__version__}; "
          f"median of {args.repeats} interleaved runs; load: median of 3 fresh processes")


if __name__ == "__main__":
    main()
