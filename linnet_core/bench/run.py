"""The bench itself: prepare every side, load each in its own worker, interleave the timed runs.

Order of work: compile Linnet's artifacts and write the exports the comparators run on (timed,
cold unless already cached); measure the memory bandwidth; start the workers one at a time (each
load timed alone, from a cold process); warm-ups, then the timed rounds, each round visiting
every side, in reverse order every other round; then each side's peak memory, and its logits on
the first prompt against the reference's. Ctrl-C stops the rounds and keeps what was measured.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from ..backends import get_backend
from ..backends.artifact import WEIGHTS_FILE
from ..compile import Model, compile_model, open_model, pick_dtype
from ..dtypes import FORMATS
from ..errors import CacheError, InputError, LinnetError
from ..export.gguf_export import export_gguf
from ..export.hf_export import export_hf
from ..memory import GIB, available_bytes, check_fits, weight_bytes
from ..tokenizer import Tokenizer
from ..weights import drop_cached
from .machine import decode_bytes_per_step, environment, stream_bandwidth
from .subjects import BASELINE, Method, Subject, why_missing

LOAD_TIMEOUT_S = 3600.0  # a compiled comparator may compile for minutes while loading
RUN_TIMEOUT_S = 1800.0
# A GGUF model: llama.cpp runs the very file; transformers loads Linnet's Hugging Face export of it.
GGUF_SOURCE_LABEL = "llama.cpp on the file"
GGUF_SOURCE_NOTE = "llama-cpp-python on the GGUF itself, with its defaults (f16 KV cache); one sequence"


@dataclass
class Side:
    subject: Subject
    status: str = "ok"  # ok | missing | failed
    reason: str | None = None
    prepare_s: float | None = None  # Linnet: the cold compile (None when cached); comparators: the export
    cached: bool | None = None
    load_s: float | None = None
    samples: list[dict] = field(default_factory=list)  # {"ttft_s", "decode_tok_s"} per timed run
    memory: dict | None = None
    distance: float | None = None
    extra: dict = field(default_factory=dict)  # what its worker needs beyond the model (an export's path)
    bandwidth_probe: float | None = None  # --sequential: the probe just before its runs
    worker: object = field(default=None, repr=False)

    def median(self, key: str) -> float | None:
        values = [s[key] for s in self.samples]
        return statistics.median(values) if values else None

    def fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason

    def speculative(self) -> dict | None:
        """With --speculate/--draft: each run's plain decode beside the speculative one (medians), the
        acceptance rate and tokens per target step, and whether every run chose the plain run's tokens."""
        if not self.samples or "plain_decode_tok_s" not in self.samples[0]:
            return None
        spec, plain = self.median("decode_tok_s"), self.median("plain_decode_tok_s")
        same = [s["same_output"] for s in self.samples if "same_output" in s]
        return {"decode_tok_s": spec, "plain_decode_tok_s": plain, "speedup": spec / plain if plain else None,
                "acceptance": self.median("acceptance"),
                "tokens_per_step": self.median("tokens_per_step") if "tokens_per_step" in self.samples[0] else None,
                "same_output": all(same) if same else None}


@dataclass
class BenchResult:
    model: str
    spec: dict
    dtype: str
    method: Method
    env: dict
    bandwidth_bytes_s: float
    bytes_per_step: float
    sides: list[Side]
    interrupted: bool = False
    time_limited: bool = False  # --time-limit ran out: what was measured by then
    completed_runs: int = 0

    def side(self, key: str) -> Side | None:
        return next((s for s in self.sides if s.subject.key == key), None)

    def rows(self) -> list[dict]:
        """Every side's figures, the ratios against the reference from this same run, and the roofline."""
        base = self.side(BASELINE)
        base_tok = base.median("decode_tok_s") if base else None
        base_ttft = base.median("ttft_s") if base else None
        out = []
        for s in self.sides:
            tok, ttft = s.median("decode_tok_s"), s.median("ttft_s")
            # a speculative step reads the weights once for several tokens: the roofline is plain decode's
            steps = s.median("plain_decode_tok_s") if s.speculative() else tok
            achieved = steps / self.method.batch * self.bytes_per_step if steps else None
            fraction = achieved / self.bandwidth_bytes_s if achieved else None
            out.append({
                "key": s.subject.key, "label": s.subject.label, "stack": s.subject.stack,
                "linnet": s.subject.is_linnet, "status": s.status, "reason": s.reason,
                "ttft_ms": ttft * 1000 if ttft else None, "decode_tok_s": tok,
                "load_s": s.load_s, "artifact_cached": s.cached, "prepare_s": s.prepare_s,
                "peak_memory_bytes": (s.memory or {}).get("peak_bytes"),
                "memory_source": (s.memory or {}).get("source"),
                "distance": s.distance,
                "decode_speedup": tok / base_tok if tok and base_tok else None,
                "ttft_speedup": base_ttft / ttft if ttft and base_ttft else None,
                "achieved_bytes_s": achieved,
                "roofline": fraction,
                # Above 100% the probe read less than the side itself moved: the probe under-read.
                "roofline_under_read": bool(fraction and fraction > 1.0),
                "bandwidth_probe_bytes_s": s.bandwidth_probe,
                "note": s.subject.note, "samples": s.samples, "speculative": s.speculative(),
            })
        return out

    def to_json(self) -> dict:
        return {"model": self.model, "spec": self.spec, "dtype": self.dtype, "method": self.method.to_json(),
                "environment": self.env, "bandwidth_bytes_s": self.bandwidth_bytes_s,
                "decode_bytes_per_step": self.bytes_per_step, "interrupted": self.interrupted,
                "time_limited": self.time_limited, "completed_runs": self.completed_runs, "sides": self.rows()}


class Deadline:
    """A bench's --time-limit: how long each wait may last so that the bench ends near it."""

    def __init__(self, seconds: float | None):
        self.at = None if seconds is None else time.monotonic() + seconds
        self.cut = False  # whether the limit stopped anything

    def hit(self) -> bool:
        """Whether the limit has passed (and so stops what the caller was about to do)."""
        if self.at is not None and time.monotonic() >= self.at:
            self.cut = True
        return self.cut

    def cap(self, timeout: float, floor: float = 0.0) -> float:
        """`timeout`, cut to the time left (never below `floor`: a last answer may still come)."""
        return timeout if self.at is None else max(floor, min(timeout, self.at - time.monotonic()))


TIME_LIMIT_REASON = "not measured: --time-limit ran out before its turn"
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*[a-z]\w*(?::|$)")  # a traceback's last line: pkg.Name: why
FINISH_FLOOR_S = 30.0  # peak memory and logits are still asked for after the limit, this long


class Reporter:
    """What the bench tells a person while it works (the CLI draws it; tests pass this silent one)."""

    def stage(self, text: str) -> None: ...
    def total(self, n: int) -> None: ...
    def advance(self, text: str) -> None: ...


class Worker:
    """A side in its own process, spoken to one JSON line at a time."""

    def __init__(self, cfg: dict, log: Path):
        self.log = log
        self._log_file = open(log, "wb")
        cfg = {**cfg, "spawned_at": time.time()}
        # A session of its own: Ctrl-C reaches the parent only, which then stops the workers.
        self.proc = subprocess.Popen([sys.executable, "-m", "linnet_core.bench.worker", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file,
                                     text=True, start_new_session=True)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def read(self, timeout: float) -> dict:
        if not self._sel.select(timeout):
            self.close()
            raise TimeoutError(f"no answer in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited ({self.tail()})")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def ask(self, request: dict, timeout: float = RUN_TIMEOUT_S) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def tail(self) -> str:
        """Why the worker ended: the exception its traceback ended with, else its last line of output
        (warnings printed after the error are skipped)."""
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        raised = [ln for ln in lines if EXCEPTION_LINE.match(ln)]
        return (raised or lines)[-1][:300] if lines else f"exit code {self.proc.poll()}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        self._sel.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a pipe to a killed worker
                pass
        self._log_file.close()


def _read_afresh(weights: Path) -> None:
    """Drop a side's weights file from the page cache before its worker maps it. The cache keeps a
    file in the pages it was first read into: one read while memory was fragmented stays in 4 KiB
    pages and streams ~20% slower (seen here: a float16 artifact 71% in 2 MiB pages, 100% once
    read afresh). Every engine then reads its file as a first run would, whatever ran before."""
    if weights.exists():
        drop_cached(weights)


def gguf_for_llama_cpp(m: Model, dtype: str, out: Path, progress) -> tuple[Path, float | None]:
    """The same weights in the bench dtype as llama.cpp reads them: a GGUF source as it is stored, else an export
    to `out`; with the export's seconds (None when nothing was exported)."""
    if m.is_gguf:
        if dtype != m.spec.dtype:
            raise InputError(f"llama.cpp runs the file as it is stored ({m.spec.dtype}); bench --dtype {m.spec.dtype} "
                             "to put it beside Linnet")
        return Path(m.path), None

    progress("exporting GGUF for llama.cpp")
    return out, export_gguf(m, out, FORMATS[dtype].gguf, force=True, check=False).seconds


def _prepare(side: Side, m: Model, dtype: str, method: Method, workdir: Path, reporter: Reporter,
             ggufs: dict[str, Path]) -> dict:
    """Whatever the side's worker needs beyond the model: a compiled artifact, or an export (each GGUF
    exported once a bench: `ggufs`, by file name)."""

    def gguf(model: Model, dtype: str, name: str, what: str) -> Path:
        if name not in ggufs:
            ggufs[name], seconds = gguf_for_llama_cpp(
                model, dtype, workdir / name, lambda text: reporter.stage(text.replace("GGUF", what)))
            if seconds is not None:
                side.prepare_s = (side.prepare_s or 0.0) + seconds
        return ggufs[name]

    s = side.subject
    if s.is_linnet:
        reporter.stage(f"compiling {s.label}")
        c = compile_model(m, s.backend, dtype, method.positions)
        side.cached = c.hit
        side.prepare_s = None if c.hit else c.seconds
        _read_afresh(c.artifact / WEIGHTS_FILE)
        spec = method.speculation
        if spec is not None and spec.chosen == "draft":  # compiled here, so the worker's load is a load
            reporter.stage(f"compiling the draft model for {s.label}")
            compile_model(open_model(spec.draft), spec.draft_backend or s.backend, spec.draft_dtype, method.positions)
        return {"backend": s.backend}
    if s.key in ("transformers", "transformers-compiled") and m.is_gguf:
        # transformers reads a GGUF's config only in part (not a head_dim apart from hidden / heads): it loads Linnet's export

        out = workdir / "hf-reference"
        if not out.exists():
            reporter.stage("exporting the GGUF as a Hugging Face checkpoint for transformers")
            side.prepare_s = export_hf(m, out, "float32" if FORMATS[dtype].quantized else dtype, check=False).seconds
        return {"model": str(out)}
    if s.key in ("llama.cpp", "llama-server"):
        target = gguf(m, dtype, "model.gguf", "GGUF")
        _read_afresh(target)
        spec = method.speculation
        if s.key == "llama.cpp" or spec is None or spec.chosen != "draft":
            return {"gguf": str(target)}
        draft = open_model(spec.draft)
        return {"gguf": str(target),
                "draft_gguf": str(gguf(draft, pick_dtype(spec.draft_dtype, draft.spec), "draft.gguf", "the draft's GGUF"))}
    if s.key in ("vllm", "sglang"):
        out = workdir / "hf"
        if not out.exists():
            reporter.stage("exporting a Hugging Face checkpoint")
            side.prepare_s = export_hf(m, out, dtype, check=False).seconds
        return {"hf_dir": str(out)}
    return {}


def bench(model: str | Path | Model | None, method: Method, subjects: list[Subject], device: str = "cpu",
          workdir: Path | None = None, reporter: Reporter | None = None,
          on_sample: Callable[[Side], None] | None = None, sequential: bool = False,
          time_limit: float | None = None) -> BenchResult:
    reporter = reporter or Reporter()
    deadline = Deadline(time_limit)
    m = model if isinstance(model, Model) else open_model(model)
    dtype = pick_dtype(method.dtype, m.spec)
    text_prompt = _file_prompt(m, method.prompt_file) if method.prompt_file else None
    if text_prompt is not None:
        method = replace(method, prompt_tokens=len(text_prompt))
    own_workdir = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="linnet-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sides = [Side(replace(s, label=GGUF_SOURCE_LABEL, note=GGUF_SOURCE_NOTE) if m.is_gguf and s.key == "llama.cpp"
                  else s) for s in subjects]
    for side in sides:
        why = why_missing(side.subject, dtype, method.batch, device) or _too_big(side.subject, m, dtype, method, device)
        if why:
            side.status, side.reason = "missing", why
    if text_prompt is None:
        rng = np.random.default_rng(method.seed)
        prompts = [rng.integers(0, m.spec.vocab_size, method.prompt_tokens).tolist() for _ in range(method.batch)]
    else:
        prompts = [text_prompt] * method.batch
    result = BenchResult(str(m.resolved.name), m.spec.to_json(), dtype, method, environment(device), 0.0,
                         decode_bytes_per_step(m.spec, dtype,
                                               method.prompt_tokens + method.new_tokens / 2, method.batch), sides)
    ggufs: dict[str, Path] = {}
    try:
        for side in sides:
            if side.status == "ok" and deadline.hit():
                side.fail(TIME_LIMIT_REASON)
            elif side.status == "ok":
                try:
                    side.extra = _prepare(side, m, dtype, method, workdir, reporter, ggufs)
                except CacheError:
                    raise  # the machine's problem, not this side's: the bench cannot go on
                except LinnetError as e:
                    side.fail(e.message)
                except Exception as e:  # noqa: BLE001 - a backend's crash is this side's result: the others still run
                    side.fail(f"internal error: {type(e).__name__}: {e}".splitlines()[0])
        reporter.stage("measuring memory bandwidth")
        result.bandwidth_bytes_s = stream_bandwidth(device)
        ready = [s for s in sides if s.status == "ok"]
        reporter.total((method.warmups + method.runs) * len(ready))
        # Interleaved: every side loaded at once, each round visits all. One side at a time (for models
        # too big to hold once per side, and under --time-limit, so that each side that gets its turn
        # has figures): the reference first, then Linnet's sides, then the other comparators.
        one_at_a_time = sequential or time_limit is not None
        ready.sort(key=lambda s: (s.subject.key != BASELINE, not s.subject.is_linnet))
        for group in ([[s] for s in ready] if one_at_a_time else [ready]):
            for side in group:
                if deadline.hit():
                    side.fail(TIME_LIMIT_REASON)
                else:
                    _start(side, m, dtype, method, device, workdir, reporter, deadline)
            if one_at_a_time and group[0].worker is not None:  # the machine now, beside this side's runs
                reporter.stage(f"measuring memory bandwidth beside {group[0].subject.label}")
                group[0].bandwidth_probe = stream_bandwidth(device)
                result.bandwidth_bytes_s = max(result.bandwidth_bytes_s, group[0].bandwidth_probe)
            _rounds(result, group, prompts, reporter, on_sample, deadline)
            _finish(result, group, prompts[0], workdir, reporter, deadline)
            for side in group:
                if side.worker is not None:
                    side.worker.close()
                    side.worker = None
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        for side in sides:
            if side.worker is not None:
                side.worker.close()
                side.worker = None
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    measured = [len(s.samples) for s in sides if s.status == "ok"]
    result.completed_runs = min(measured) if measured else 0
    result.time_limited = deadline.cut
    # The machine is shared: the best of before and after is its bandwidth (skipped when stopped early).
    if not result.interrupted and not result.time_limited:
        result.bandwidth_bytes_s = max(result.bandwidth_bytes_s, stream_bandwidth(device))
    return result


def _file_prompt(m: Model, path: str) -> list[int]:
    """A prompt file's text as the model's tokens (a text a continuation copies from: prompt lookup's case)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the prompt file {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    tokens = Tokenizer(m.path).encode(text)
    if not tokens:
        raise InputError(f"the prompt file {path} holds no text")
    return tokens


def _too_big(subject: Subject, m: Model, dtype: str, method: Method, device: str) -> str | None:
    """Why a Linnet side, or transformers on a CPU, cannot fit in this machine's memory, from the sizes
    (before minutes of compiling, or an export of the reference as large as the model in float32)."""
    if subject.key in ("transformers", "transformers-compiled") and device == "cpu":
        wide = "float32" if FORMATS[dtype].quantized else dtype  # the reference computes on the dequantized weights
        need, free = weight_bytes(m.spec, wide) + GIB, available_bytes()
        if free is not None and need > free:
            return (f"transformers would hold the weights in {wide}: {need / GIB:.1f} GiB, and "
                    f"{free / GIB:.1f} GiB are available")
        return None
    if not subject.is_linnet:
        return None
    try:
        check_fits(m.spec, get_backend(subject.backend), dtype, method.positions, method.batch, device)
    except LinnetError as e:
        return e.message
    return None


def _start(side: Side, m: Model, dtype: str, method: Method, device: str, workdir: Path, reporter: Reporter,
           deadline: Deadline) -> None:
    reporter.stage(f"loading {side.subject.label} in a fresh process")
    cfg = {"subject": side.subject.key, "model": str(m.path), "dtype": dtype, "positions": method.positions,
           "batch": method.batch, "device": device, "threads": torch.get_num_threads(), **side.extra,
           "speculation": asdict(method.speculation) if method.speculation else None, "workdir": str(workdir)}
    log = workdir / f"{side.subject.key.replace(':', '-').replace('.', '')}.log"
    side.worker = Worker(cfg, log)
    try:
        ready = side.worker.read(deadline.cap(LOAD_TIMEOUT_S, floor=1.0))
    except (RuntimeError, TimeoutError) as e:
        side.fail(f"failed to load: {e}")
        side.worker.close()
        side.worker = None
        return
    side.load_s = ready["load_s"]
    if ready.get("cached") is not None:
        side.cached = ready["cached"]


def _rounds(result: BenchResult, group: list[Side], prompts: list[list[int]], reporter: Reporter, on_sample,
            deadline: Deadline) -> None:
    method = result.method
    live = [s for s in group if s.worker is not None]
    for r in range(method.warmups + method.runs):
        if deadline.hit():  # the sides keep the runs they finished
            for side in live:
                if side.worker is not None and not side.samples:
                    side.fail("no timed run finished within --time-limit")
            return
        order = live if r % 2 == 0 else live[::-1]
        warm = r < method.warmups
        for side in order:
            if side.worker is None:
                continue
            what = f"warm-up {r + 1}/{method.warmups}" if warm else f"run {r - method.warmups + 1}/{method.runs}"
            try:
                sample = side.worker.ask({"op": "run", "prompts": prompts, "new": method.new_tokens},
                                         deadline.cap(RUN_TIMEOUT_S, floor=FINISH_FLOOR_S))
            except (RuntimeError, TimeoutError) as e:
                side.fail(f"failed during the runs: {e}")
                side.worker.close()
                side.worker = None
                continue
            if not warm:
                side.samples.append(sample)
                if on_sample:
                    on_sample(side)
            reporter.advance(f"{what}: {side.subject.label}")


def _finish(result: BenchResult, group: list[Side], prompt: list[int], workdir: Path, reporter: Reporter,
            deadline: Deadline) -> None:
    """Peak memory first (the logits below may allocate), then each side's distance from the reference
    (whose logits the reference's worker leaves in the workdir: it runs in the first group)."""
    reporter.stage("peak memory and distance from reference")
    live = sorted((s for s in group if s.worker is not None), key=lambda s: s.subject.key != BASELINE)
    for side in live:
        try:
            side.memory = side.worker.ask({"op": "memory"}, deadline.cap(RUN_TIMEOUT_S, floor=FINISH_FLOOR_S))
        except (RuntimeError, TimeoutError) as e:
            side.reason = f"no peak memory: {e}"
            side.worker.close()
            side.worker = None
    ref_path = workdir / "reference.npy"
    for side in (s for s in live if s.worker is not None):
        out = ref_path if side.subject.key == BASELINE else workdir / f"logits-{len(os.listdir(workdir))}.npy"
        try:
            written = side.worker.ask({"op": "logits", "prompt": prompt, "out": str(out)},
                                      deadline.cap(RUN_TIMEOUT_S, floor=FINISH_FLOOR_S))["written"]
        except (RuntimeError, TimeoutError) as e:
            side.reason = f"no distance: {e}"
            continue
        if written and ref_path.is_file():
            side.distance = float(np.abs(np.load(out) - np.load(ref_path)).max())
