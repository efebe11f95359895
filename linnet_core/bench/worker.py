"""One bench side in a process of its own: load it, then answer the parent's requests.

    python -m linnet_core.bench.worker '<json config>'

One JSON object per line each way. The first line out is `{"ready": true, "load_s": ...}` (from
the parent's spawn, imports included, to a model that has produced a token) or `{"error": ...}`.
Requests: `{"op": "run", "prompts": [[...]], "new": N}` -> ttft_s and decode_tok_s;
`{"op": "logits", "prompt": [...], "out": path}` writes the last position's logits (.npy);
`{"op": "memory"}` -> the process's peak; `{"op": "exit"}`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..check.reference import as_quantized
from ..dtypes import FORMATS, torch_dtype
from ..gguf.llama_open import open_llama
from . import llama_server
from .machine import peak_rss

# Keep stdout for the protocol: library chatter goes to stderr.
_protocol = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def send(obj: dict) -> None:
    _protocol.write(json.dumps(obj) + "\n")


class MemoryWatch:
    """Peak memory of this process: the driver's figure on a GPU (NVML, polled), peak RSS on CPU."""

    def __init__(self, device: str):
        self.device, self.peak_gpu, self._nvml = device, 0, None
        if device == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                threading.Thread(target=self._poll, daemon=True).start()
            except Exception:  # noqa: BLE001 - no NVML bindings or driver: torch's own figure below
                self._nvml = None

    def _poll(self) -> None:
        nv, pid = self._nvml, os.getpid()
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        while True:
            used = 0
            for h in handles:
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.pid == pid and p.usedGpuMemory:
                        used += p.usedGpuMemory
            self.peak_gpu = max(self.peak_gpu, used)
            time.sleep(0.05)

    @staticmethod
    def peak_rss() -> int:
        peak = peak_rss()
        if peak is not None:
            return peak
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def report(self) -> dict:
        rss = self.peak_rss()
        if self.device != "cuda":
            return {"peak_bytes": rss, "source": "peak RSS"}
        if self._nvml is not None and self.peak_gpu:
            return {"peak_bytes": self.peak_gpu, "source": "NVML, this process", "peak_rss_bytes": rss}
        import torch

        return {"peak_bytes": torch.cuda.max_memory_reserved(), "source": "torch.cuda.max_memory_reserved",
                "peak_rss_bytes": rss}


def in_turn(turn: bool) -> tuple[str, str]:
    """The order of a run's plain and speculative decode, flipped each run: neither always follows
    the other (and inherits its warm caches or the bus's minute)."""
    return ("plain", "speculative") if turn else ("speculative", "plain")


class LinnetRunner:
    def __init__(self, cfg: dict):
        from ..compile import load_model  # imports torch: not at start-up

        self.batch = cfg["batch"]
        self.session, compiled = load_model(cfg["model"], cfg["backend"], cfg["dtype"], cfg["positions"],
                                            rows=self.batch, device=cfg["device"])
        self.cached = compiled.hit
        self.speculation, self.turn = None, False
        if cfg.get("speculation"):
            from ..speculation import SpeculationOptions, load_speculation  # imports torch: not at start-up

            self.speculation, _ = load_speculation(SpeculationOptions(**cfg["speculation"]), compiled, self.session)
        self.session.prefill([1, 2])
        self.session.decode([3], [2], [0])

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, float] | dict:
        if self.speculation is not None:
            return self.with_and_without(prompts[0], new)
        s, rows = self.session, list(range(len(prompts)))
        t0 = time.perf_counter()
        tokens = [s.prefill(p, slot=i).tokens[0] for i, p in enumerate(prompts)]
        ttft = time.perf_counter() - t0
        positions = [len(p) for p in prompts]
        t1 = time.perf_counter()
        for _ in range(new - 1):
            tokens = s.decode(tokens, positions, rows).tokens
            positions = [p + 1 for p in positions]
        return ttft, (new - 1) * len(prompts) / (time.perf_counter() - t1)

    def with_and_without(self, prompt: list[int], new: int) -> dict:
        """A plain greedy run and a speculative one of the same prompt: the side's figures are the
        speculative run's, the plain run's beside them, and whether the two chose the same tokens."""
        from ..runtime.generate import Generation  # imports torch: not at start-up

        plain = Generation(self.session, prompt, new)
        spec = Generation(self.session, prompt, new, speculation=self.speculation)
        self.turn = not self.turn
        runs = {"plain": plain, "speculative": spec}
        tokens = {name: list(runs[name]) for name in in_turn(self.turn)}
        plain_tokens, spec_tokens = tokens["plain"], tokens["speculative"]
        return {"ttft_s": spec.stats.ttft_s, "decode_tok_s": spec.stats.decode_tok_s,
                "plain_decode_tok_s": plain.stats.decode_tok_s, "acceptance": spec.speculative.acceptance,
                "tokens_per_step": spec.speculative.tokens_per_step, "same_output": plain_tokens == spec_tokens}

    def logits(self, prompt: list[int]) -> np.ndarray:
        return np.asarray(self.session.prefill(prompt, logits="last").logits[0, -1], dtype=np.float32)


class TransformersRunner:
    """transformers eager (its dynamic KV cache), or its forward under torch.compile over a static
    cache; either way prefill, then one forward per new token, greedy."""

    def __init__(self, cfg: dict, compiled: bool):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        self.torch, self.device, self.batch = torch, cfg["device"], cfg["batch"]

        self.model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch_dtype(cfg["dtype"])).eval()
        if FORMATS[cfg["dtype"]].quantized:  # float32 over the dequantized blocks: distances are kernels' alone
            from ..compile import open_model  # imports torch: not at start-up

            as_quantized(self.model, open_model(cfg["model"]).spec, cfg["dtype"])
        self.model.to(self.device)
        self.cache = None
        if compiled:
            from transformers import StaticCache

            mode = "reduce-overhead" if self.device == "cuda" else None
            self.model.forward = torch.compile(self.model.forward, fullgraph=True, mode=mode)
            self.cache = StaticCache(config=self.model.config, max_cache_len=cfg["positions"])
        self.run([[1, 2] * 4] * cfg["batch"], 3)  # ready = produced tokens (compiled: compiled too)
        self.cached = None

    def _forward(self, ids, past, start: int):
        torch = self.torch
        if self.cache is None:
            return self.model(ids, past_key_values=past, use_cache=True)
        positions = torch.arange(start, start + ids.shape[1], device=self.device)
        return self.model(ids, past_key_values=self.cache, cache_position=positions, use_cache=True)

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, float]:
        torch = self.torch
        ids = torch.tensor(prompts, device=self.device)
        with torch.inference_mode():
            if self.cache is not None:
                self.cache.reset()
            t0 = time.perf_counter()
            out = self._forward(ids, None, 0)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            self._sync()
            ttft = time.perf_counter() - t0
            past, pos = out.past_key_values, ids.shape[1]
            t1 = time.perf_counter()
            for _ in range(new - 1):
                out = self._forward(token, past, pos)
                past, pos = out.past_key_values, pos + 1
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            self._sync()
        return ttft, (new - 1) * len(prompts) / (time.perf_counter() - t1)

    def logits(self, prompt: list[int]) -> np.ndarray:
        torch = self.torch
        rows = self.batch if self.cache is not None else 1  # a static cache has its batch built in
        with torch.inference_mode():
            if self.cache is not None:
                self.cache.reset()
            out = self._forward(torch.tensor([prompt] * rows, device=self.device), None, 0)
        return out.logits[0, -1].float().cpu().numpy()


class LlamaCppRunner:
    def __init__(self, cfg: dict):
        # The thread count comes from the parent: importing PyTorch here only for it would add its
        # ~0.2 GiB to llama.cpp's peak memory.
        self.path, self.positions = cfg["gguf"], cfg["positions"]
        gpu_layers = -1 if cfg["device"] == "cuda" else 0
        self.llm = open_llama(model_path=self.path, n_ctx=self.positions, n_batch=512, n_gpu_layers=gpu_layers,
                              n_threads=cfg["threads"], verbose=False)
        self.run([[1, 2, 3, 4]], 2)
        self.cached = None

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, float]:
        # generate() would reuse the previous run's KV cache for a matching prefix (all of the
        # prompt here): clear it, so every run prefills the whole prompt.
        self.llm.reset()
        t0 = time.perf_counter()
        gen = self.llm.generate(prompts[0], top_k=1, top_p=1.0, temp=0.0, reset=True)
        next(gen)
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(new - 1):
            next(gen)
        return ttft, (new - 1) / (time.perf_counter() - t1)

    def logits(self, prompt: list[int]) -> np.ndarray:
        # The timed model keeps no logits (llama-cpp-python stores them only with logits_all).
        llm = open_llama(model_path=self.path, n_ctx=self.positions, n_batch=512, logits_all=True, verbose=False,
                         n_gpu_layers=self.llm.model_params.n_gpu_layers)
        try:
            llm.eval(prompt)
            return np.array(llm.scores[len(prompt) - 1], dtype=np.float32)
        finally:
            llm.close()


class LlamaServerRunner:
    """llama.cpp's llama-server on the GGUF, one /completion at a time (greedy, EOS ignored), timed by its
    own timings. With speculation, two servers: one speculating as llama.cpp does (the draft GGUF, or
    its n-gram lookup; k proposed, no confidence cut-off) and a plain one, each run timing both."""

    def __init__(self, cfg: dict):
        binary, spec = llama_server.require(), cfg.get("speculation")
        logs, self.servers, self.turn = Path(cfg["workdir"]), {}, False
        plans = {"plain": ()}
        if spec:
            k = str(spec["draft_tokens"])
            plans["speculative"] = (
                ("-md", cfg["draft_gguf"], "--spec-type", "draft-simple", "--spec-draft-n-max", k,
                 "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", str(cfg["threads"]))
                if cfg.get("draft_gguf") else
                ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", k))
        try:
            for name, flags in plans.items():
                proc, url, _ = llama_server.start(binary, Path(cfg["gguf"]), 1, cfg["positions"], cfg["threads"],
                                                  logs / f"llama-server-{name}.log", flags=flags)
                self.servers[name] = (proc, url)
        except BaseException:
            self.close()
            raise
        self.run([[1, 2, 3, 4]], 2)
        self.cached = None

    def _complete(self, name: str, prompt: list[int], new: int) -> dict:
        import httpx

        body = {"prompt": prompt, "n_predict": new, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "ignore_eos": True, "stream": False}
        r = httpx.post(f"{self.servers[name][1]}/completion", json=body, timeout=1800)
        r.raise_for_status()
        t = r.json()["timings"]
        # its eval time runs from the first token on: the decode steps after it, as every side counts them
        decode = (t["predicted_n"] - 1) / (t["predicted_ms"] / 1000) if t["predicted_ms"] > 0 else 0.0
        return {"ttft_s": t["prompt_ms"] / 1000, "decode_tok_s": decode, "draft_n": t.get("draft_n"),
                "draft_accepted": t.get("draft_n_accepted")}

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, float] | dict:
        if "speculative" not in self.servers:
            plain = self._complete("plain", prompts[0], new)
            return plain["ttft_s"], plain["decode_tok_s"]
        self.turn = not self.turn
        got = {name: self._complete(name, prompts[0], new) for name in in_turn(self.turn)}
        plain, spec = got["plain"], got["speculative"]
        proposed, accepted = spec["draft_n"] or 0, spec["draft_accepted"] or 0
        return {"ttft_s": spec["ttft_s"], "decode_tok_s": spec["decode_tok_s"],
                "plain_decode_tok_s": plain["decode_tok_s"], "acceptance": accepted / proposed if proposed else 0.0}

    def logits(self, prompt: list[int]) -> None:
        return None  # its /completion gives probabilities of a few tokens, not logits

    def memory(self) -> dict:
        proc = self.servers.get("speculative", self.servers["plain"])[0]
        return {"peak_bytes": peak_rss(proc.pid), "source": "peak RSS of its llama-server"}

    def close(self) -> None:
        for proc, _ in self.servers.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.servers = {}


class VllmRunner:
    """vLLM's offline engine on Linnet's HF export; TTFT is a one-token request's time."""

    def __init__(self, cfg: dict):
        from vllm import LLM

        self.llm = LLM(model=cfg["hf_dir"], dtype=cfg["dtype"], max_model_len=cfg["positions"],
                       gpu_memory_utilization=0.85, seed=0)
        self.run([[1, 2, 3, 4]], 2)
        self.cached = None

    def _generate(self, prompts, n: int) -> float:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, float]:
        ttft = self._generate(prompts, 1)
        return ttft, (new - 1) * len(prompts) / (self._generate(prompts, new) - ttft)

    def logits(self, prompt: list[int]) -> np.ndarray | None:
        return None  # vLLM returns log-probabilities of a few tokens, not logits


class SglangRunner(VllmRunner):
    def __init__(self, cfg: dict):
        import sglang

        self.engine = sglang.Engine(model_path=cfg["hf_dir"], dtype=cfg["dtype"], mem_fraction_static=0.85,
                                    context_length=cfg["positions"], random_seed=0)
        self.run([[1, 2, 3, 4]], 2)
        self.cached = None

    def _generate(self, prompts, n: int) -> float:
        params = {"max_new_tokens": n, "min_new_tokens": n, "ignore_eos": True, "temperature": 0.0}
        t = time.perf_counter()
        self.engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - t


def make_runner(cfg: dict):
    kind = cfg["subject"]
    if kind.startswith("linnet:"):
        return LinnetRunner(cfg)
    if kind in ("transformers", "transformers-compiled"):
        return TransformersRunner(cfg, compiled=kind == "transformers-compiled")
    return {"llama.cpp": LlamaCppRunner, "llama-server": LlamaServerRunner, "vllm": VllmRunner,
            "sglang": SglangRunner}[kind](cfg)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    watch = MemoryWatch(cfg["device"])
    try:
        runner = make_runner(cfg)
    except Exception as e:  # noqa: BLE001 - any failure to load is this side's result, in one line
        send({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"})
        return
    send({"ready": True, "load_s": time.time() - cfg["spawned_at"], "cached": runner.cached})
    try:
        serve_requests(runner, watch)
    finally:
        if hasattr(runner, "close"):  # servers it started
            runner.close()


def serve_requests(runner, watch: MemoryWatch) -> None:
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "run":
                result = runner.run(req["prompts"], req["new"])
                send(result if isinstance(result, dict) else {"ttft_s": result[0], "decode_tok_s": result[1]})
            elif req["op"] == "logits":
                logits = runner.logits(req["prompt"])
                if logits is not None:
                    np.save(req["out"], logits)
                send({"written": logits is not None})
            elif req["op"] == "memory":
                send(runner.memory() if hasattr(runner, "memory") else watch.report())
            elif req["op"] == "exit":
                break
        except Exception as e:  # noqa: BLE001 - reported to the parent, which marks the side failed
            send({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"})


if __name__ == "__main__":
    main()
    _protocol.flush()
    os._exit(0)  # skip interpreter teardown: some runtimes take seconds to unload
