"""The GPU pass: every CUDA path checked and the reference pages' numbers measured, in one call.

    OUT=/tmp/out scripts/gpu_pass.sh              # on a GPU machine: about 8 minutes, nothing fetched
    OUT=/tmp/out scripts/gpu_pass.sh --dry-run    # the same steps on this CPU at tiny sizes (a test runs it)

Steps, in this order, each in its own process group and time box, so a step that fails or hangs
costs its box and no more, and whatever the earlier steps found is written all the same:
install Linnet from this tree (offline, no build isolation), `linnet doctor --json`, the
`gpu`-marked tests, `verify` of every backend x family fixture x bfloat16/float16/q4_0 on the device,
and `linnet bench` of the Qwen3-4B shape (random weights from bench/make_seed_models.py) against
transformers eager and compiled. The seed model is written and compiled for each backend in the
background from the start, so the bench step finds its artifacts cached.

Into $OUT (at most 8 files, each under 16 MiB): pass.json (every step's status and time, the
verify table, the bench digest against the HBM roofline), pass.log, doctor.json, tests.log,
verify.json, bench.json, bench.html.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_BYTES = 15 * 2**20  # what comes back from a lent machine: each file under 16 MiB
STEPS = ("doctor", "tests", "verify", "bench")
OUTPUTS = ("pass.json", "pass.log", "doctor.json", "tests.log", "verify.json", "bench.json", "bench.html")


@dataclass
class Plan:
    """What one pass covers; the dry run is the same steps on the CPU at test sizes."""

    device: str
    backends: list[str]
    cases: list[str]  # tests/family_fixtures.py cases verified on every backend
    dtypes: list[str]
    tiny: bool  # the seed model at test size
    prompt_tokens: int
    new_tokens: int
    runs: int
    warmups: int
    compare: list[str]  # bench comparators besides transformers eager
    budget_s: float
    shares: dict[str, float]  # seconds per step; the bench gets what is left
    parallel: int  # verify processes at a time
    seed: str = "qwen3-4b"
    dtype: str = "bfloat16"  # the bench's

    @property
    def cache_len(self) -> int:
        return self.prompt_tokens + self.new_tokens


GPU = Plan(device="cuda", backends=["torch", "inductor", "cudagraphs", "jax", "stablehlo", "onnxruntime", "tensorrt"],
           cases=["llama-gqa-untied", "mistral-window", "qwen2-bias-tied", "qwen3-headdim128", "phi3-fused-window"],
           dtypes=["bfloat16", "float16", "q4_0"], tiny=False, prompt_tokens=512, new_tokens=128, runs=3, warmups=1,
           compare=["transformers-compiled"], budget_s=480,
           shares={"install": 45, "doctor": 30, "fixtures": 30, "tests": 90, "verify": 105}, parallel=12)
# CPU backends that compile in seconds on 2 cores, plus the two GPU-only ones (which must report
# themselves missing); inductor is left to the test suite, where it takes minutes here.
DRY = Plan(device="cpu", backends=["torch", "jax", "stablehlo", "onnxruntime", "cudagraphs", "tensorrt"],
           cases=["qwen3-headdim128"], dtypes=["bfloat16", "float16", "q8_0"], tiny=True, prompt_tokens=32, new_tokens=8,
           runs=2, warmups=1, compare=[], budget_s=420,
           shares={"install": 90, "doctor": 30, "fixtures": 30, "tests": 90, "verify": 90}, parallel=6)


@dataclass
class StepResult:
    step: str
    status: str  # ok | failed | timed out | skipped
    seconds: float
    rc: int | None = None
    detail: str = ""


@dataclass
class Pass:
    plan: Plan
    out: Path
    work: Path
    started: float = field(default_factory=time.monotonic)
    steps: list[StepResult] = field(default_factory=list)

    @property
    def log(self) -> Path:
        return self.out / "pass.log"

    def left(self) -> float:
        return self.plan.budget_s - (time.monotonic() - self.started)

    def box(self, step: str) -> float:
        """The step's share, cut to what the budget has left (a few seconds kept for the report)."""
        return max(1.0, min(self.plan.shares.get(step, self.left()), self.left() - 10))

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f} s] {text}"
        print(line, flush=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def env(self) -> dict[str, str]:
        site = self.work / "site"
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "tests")]),
                "PATH": f"{site / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                "LINNET_CACHE": str(self.work / "cache"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "TRANSFORMERS_VERBOSITY": "error",
                # up to 17 processes compile at once: a pool of 16 compile workers in each (inductor's
                # default here) is what the second pass's verify lost as "SubprocException"
                "TORCHINDUCTOR_COMPILE_THREADS": "1"}

    def start(self, cmd: list[str], stdout=None) -> subprocess.Popen:
        """A child in a process group of its own (so a time box ends all of it), stderr to the log."""
        with open(self.log, "ab") as log:
            return subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=stdout or log, stderr=log,
                                    start_new_session=True)

    def run(self, step: str, cmd: list[str], timeout: float, stdout: Path | None = None) -> StepResult:
        self.say(f"{step}: {' '.join(cmd)} (at most {timeout:.0f} s)")
        t0 = time.monotonic()
        with open(stdout, "wb") if stdout else open(os.devnull, "wb") as sink:
            proc = self.start(cmd, sink if stdout else None)
            rc = wait(proc, timeout)
        seconds = time.monotonic() - t0
        status = "timed out" if rc is None else "ok" if rc == 0 else "failed"
        result = StepResult(step, status, round(seconds, 1), rc)
        self.say(f"{step}: {status} in {seconds:.1f} s" + (f" (exit {rc})" if rc not in (0, None) else ""))
        return result

    def record(self, result: StepResult) -> StepResult:
        self.steps.append(result)
        return result


def wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit code, or None after ending the whole process group at the time box."""
    try:
        return proc.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        stop(proc)
        return None


def stop(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


# --- the steps -------------------------------------------------------------------------------

def install(p: Pass) -> StepResult:
    """Linnet from this tree into a folder of its own: no index, no build isolation, no dependencies."""
    site = p.work / "site"
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--target", str(site), str(ROOT)]
    return p.record(p.run("install", cmd, p.box("install")))


def doctor(p: Pass) -> StepResult:
    out = p.out / "doctor.json"
    r = p.run("doctor", ["linnet", "doctor", "--json"], p.box("doctor"), stdout=out)
    try:
        doc = json.loads(out.read_text())
    except (OSError, ValueError):
        r.detail = "no JSON"
        return p.record(r)
    if r.status == "failed":  # doctor exits non-zero when something is not ready: that is still its answer
        r.status = "ok"
    checks = [c for section in doc.values() if isinstance(section, list) for c in section if "ready" in c]
    r.detail = f"not ready: {', '.join(c['name'] for c in checks if not c['ready']) or 'none'}"
    return p.record(r)


def tests(p: Pass) -> tuple[StepResult, dict]:
    out = p.out / "tests.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider", str(ROOT / "tests")]
    r = p.run("tests", cmd, p.box("tests"), stdout=out)
    counts = pytest_counts(out.read_text(errors="replace") if out.is_file() else "")
    if r.rc == 5:  # pytest: no test selected; on a CPU every gpu test is skipped instead
        r.status = "ok"
    r.detail = ", ".join(f"{v} {k}" for k, v in counts.items())
    return p.record(r), counts


def pytest_counts(text: str) -> dict[str, int]:
    """{'passed': n, 'failed': n, ...} from pytest's last summary line."""
    import re

    for line in reversed(text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", line)
        if found:
            return {k: int(n) for n, k in found}
    return {}


def fixtures(p: Pass) -> StepResult:
    cmd = [sys.executable, str(Path(__file__)), "fixtures", str(p.work / "fixtures"), *p.plan.cases]
    return p.record(p.run("fixtures", cmd, p.box("fixtures")))


def verify_all(p: Pass) -> tuple[StepResult, list[dict]]:
    """One process per (backend, fixture), `plan.parallel` at a time; each writes a JSON line per dtype
    as it goes, so a step cut short still reports what finished."""
    timeout = p.box("verify")
    jobs = [(b, case) for b in p.plan.backends for case in p.plan.cases]
    p.say(f"verify: {len(p.plan.backends)} backends x {len(p.plan.cases)} fixtures x {len(p.plan.dtypes)} dtypes "
          f"on {p.plan.device}, {p.plan.parallel} processes at a time (at most {timeout:.0f} s)")
    t0 = time.monotonic()
    lines = {job: p.work / f"verify-{job[0]}-{job[1]}.jsonl" for job in jobs}
    waiting, running, ended = list(jobs), {}, {}
    while (waiting or running) and time.monotonic() - t0 < timeout:
        while waiting and len(running) < p.plan.parallel:
            b, case = job = waiting.pop(0)
            lines[job].unlink(missing_ok=True)
            running[job] = p.start([sys.executable, str(Path(__file__)), "verify-worker", "--backend", b,
                                    "--device", p.plan.device, "--dtypes", ",".join(p.plan.dtypes),
                                    "--fixtures", str(p.work / "fixtures"), "--cases", case, "--out", str(lines[job])])
        for job, proc in list(running.items()):
            if proc.poll() is not None:
                ended[job] = running.pop(job).returncode
        time.sleep(0.2)
    for job, proc in running.items():
        stop(proc)
    records, late = [], sorted({b for b, _ in [*running, *waiting]}, key=p.plan.backends.index)
    for job in jobs:
        b, case = job
        got = read_jsonl(lines[job])
        done = {r["dtype"] for r in got}
        why = (f"its worker exited ({ended[job]})" if job in ended else "the verify step's time box ran out first")
        got += [{"backend": b, "case": case, "dtype": d, "status": "not run", "reason": why}
                for d in p.plan.dtypes if d not in done]
        records += got
    (p.out / "verify.json").write_text(json.dumps(records, indent=2) + "\n")
    bad = [r for r in records if r["status"] in ("failed", "error")]
    seconds = round(time.monotonic() - t0, 1)
    status = "timed out" if late else "failed" if bad else "ok"
    tally = {s: sum(r["status"] == s for r in records) for s in ("passed", "failed", "missing", "error", "not run")}
    detail = ", ".join(f"{n} {s}" for s, n in tally.items() if n) + (f"; cut short: {', '.join(late)}" if late else "")
    p.say(f"verify: {status} in {seconds} s ({detail})")
    return p.record(StepResult("verify", status, seconds, detail=detail)), records


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut off when its worker was ended
                pass
    return out


class Preparation:
    """The bench's model and artifacts, made in the background while the other steps run:
    the seed checkpoint, then `linnet compile` of it for every backend at once."""

    def __init__(self, p: Pass):
        self.p, self.model = p, p.work / "seed" / p.plan.seed
        self.procs: dict[str, subprocess.Popen] = {}
        self.lock, self.abandoned = threading.Lock(), False
        cmd = [sys.executable, str(ROOT / "bench" / "make_seed_models.py"), p.plan.seed, str(self.model)]
        if (self.model / "config.json").is_file():  # a rerun on the same machine: the seed is written whole or not at all
            cmd = [sys.executable, "-c", ""]
            p.say(f"background: reusing the seed model in {self.model}")
        else:
            cmd += ["--tiny"] if p.plan.tiny else []
            p.say(f"background: writing the {p.plan.seed} seed model{' (tiny)' if p.plan.tiny else ''} into {self.model}")
        self.seed = p.start(cmd)
        self.seed_rc: int | None = None
        self.thread = threading.Thread(target=self._compile_when_written, daemon=True)
        self.thread.start()

    def _compile_when_written(self) -> None:
        rc = self.seed.wait()
        with self.lock:
            self.seed_rc = rc
            if rc != 0 or self.abandoned:
                self.p.say(f"background: the seed model failed (exit {rc})" if rc else "background: abandoned")
                return
            self.p.say("background: seed model written; compiling it for every backend at once")
            for b in self.p.plan.backends:
                self.procs[b] = self.p.start(["linnet", "compile", str(self.model), "--backend", b, "--dtype",
                                              self.p.plan.dtype, "--cache-len", str(self.p.plan.cache_len), "-q"])

    def finish(self, timeout: float) -> dict[str, str]:
        """Wait for the compiles (a failed one is the bench's to report); what each came to."""
        end = time.monotonic() + timeout
        self.thread.join(timeout)
        if self.thread.is_alive():
            stop(self.seed)
            self.thread.join()
        out = {}
        for b, proc in self.procs.items():
            rc = wait(proc, end - time.monotonic())
            out[b] = "compiled" if rc == 0 else "timed out" if rc is None else f"exit {rc}"
        return out

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True
        for proc in [self.seed, *self.procs.values()]:
            if proc.poll() is None:
                stop(proc)


def bench_step(p: Pass, prep: Preparation) -> tuple[StepResult, dict]:
    t0 = time.monotonic()
    compiled = prep.finish(max(1.0, p.left() * 0.5))
    p.say(f"bench: artifacts {compiled}")
    if prep.seed_rc != 0:
        return p.record(StepResult("bench", "failed", round(time.monotonic() - t0, 1),
                                   detail="no seed model (see pass.log)")), {}
    limit = max(5.0, p.left() - 25)
    cmd = ["linnet", "bench", str(prep.model), "--dtype", p.plan.dtype, "--device", p.plan.device,
           "--prompt-tokens", str(p.plan.prompt_tokens), "--new-tokens", str(p.plan.new_tokens),
           "--runs", str(p.plan.runs), "--warmups", str(p.plan.warmups), "--backend", ",".join(p.plan.backends),
           "--compare", ",".join(p.plan.compare) or "none", "--save", str(p.out / "bench.json"),
           "--html", str(p.out / "bench.html"), "--workdir", str(p.work / "bench"), "--time-limit", f"{limit:.0f}",
           "--quiet"]
    r = p.run("bench", cmd, limit + 20)
    r.seconds = round(time.monotonic() - t0, 1)
    try:
        digest = bench_digest(json.loads((p.out / "bench.json").read_text()))
    except (OSError, ValueError):
        digest = {}
    r.detail = "; ".join(f"{row['label']}: {row['decode_tok_s']:.1f} tok/s" for row in digest.get("rows", [])
                         if row.get("decode_tok_s"))
    return p.record(r), {"artifacts": compiled, **digest}


def bench_digest(doc: dict) -> dict:
    """Decode speed of each side against the roofline: the measured copy bandwidth, and 80% of the
    datasheet's (the pages' goal at batch 1)."""
    per_step = doc["decode_bytes_per_step"]
    batch = doc["method"]["batch"]
    nominal = doc["environment"].get("gpu_nominal_bandwidth_bytes_s")
    goal = 0.8 * nominal / per_step * batch if nominal else None
    rows = []
    for s in doc["sides"]:
        tok = s.get("decode_tok_s")
        rows.append({"label": s["label"], "status": s["status"], "reason": s.get("reason"), "decode_tok_s": tok,
                     "ttft_ms": s.get("ttft_ms"), "load_s": s.get("load_s"), "peak_memory_bytes": s.get("peak_memory_bytes"),
                     "distance": s.get("distance"), "roofline_measured": s.get("roofline"),
                     "of_goal": tok / goal if tok and goal else None})
    return {"bytes_per_step": per_step, "measured_bandwidth_bytes_s": doc["bandwidth_bytes_s"],
            "nominal_bandwidth_bytes_s": nominal, "goal_tok_s": goal, "time_limited": doc.get("time_limited"),
            "rows": rows}


def markdown(summary: dict) -> str:
    """The figures a README wants, as Markdown tables."""
    lines = ["| step | status | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['detail']} |" for s in summary["steps"]]
    verify = summary.get("verify") or []
    if verify:
        lines += ["", "| backend | fixture | dtype | result | distance / tolerance |", "|---|---|---|---|---|"]
        for r in verify:
            dist = f"{r['distance']:.3g} / {r['tolerance']:.3g}" if r.get("distance") is not None else r.get("reason", "")
            lines.append(f"| {r['backend']} | {r['case']} | {r['dtype']} | {r['status']} | {dist} |")
    rows = (summary.get("bench") or {}).get("rows") or []
    if rows:
        goal = summary["bench"].get("goal_tok_s")
        lines += ["", f"| side | decode tok/s | TTFT ms | of the goal ({goal:.0f} tok/s) | note |" if goal else
                  "| side | decode tok/s | TTFT ms | roofline (measured) | note |", "|---|---|---|---|---|"]
        for r in rows:
            tok = f"{r['decode_tok_s']:.1f}" if r.get("decode_tok_s") else "–"
            ttft = f"{r['ttft_ms']:.1f}" if r.get("ttft_ms") else "–"
            frac = r.get("of_goal") if goal else r.get("roofline_measured")
            lines.append(f"| {r['label']} | {tok} | {ttft} | {f'{frac:.0%}' if frac else '–'} | "
                         f"{(r.get('reason') or '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def cap_outputs(out: Path) -> None:
    """Every file under the size that comes back: logs keep their tail, the rest is never that big."""
    for f in out.iterdir():
        if f.is_file() and f.stat().st_size > MAX_FILE_BYTES:
            data = f.read_bytes()[-MAX_FILE_BYTES + 200:]
            f.write_bytes(b"[... cut: only the last 15 MiB are kept ...]\n" + data)


def main_pass(args) -> int:
    plan = DRY if args.dry_run else GPU
    if args.budget:
        plan.budget_s = args.budget
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    work = Path(args.work or ("/tmp/linnet-gpu-pass" + ("-dry" if args.dry_run else ""))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    p = Pass(plan, out, work)
    p.say(f"GPU pass{' (dry run on the CPU)' if args.dry_run else ''}: budget {plan.budget_s:.0f} s, out {out}, "
          f"work {work}")
    summary: dict = {"dry_run": args.dry_run, "plan": asdict(plan), "steps": []}
    prep = None
    try:
        if install(p).status != "ok":
            p.say("install failed: nothing else can run (see pass.log)")
            return finish(p, summary)
        prep = Preparation(p) if "bench" in args.steps else None
        if "doctor" in args.steps:
            doctor(p)
        if "tests" in args.steps:
            summary["tests"] = tests(p)[1]
        if "verify" in args.steps:
            fixtures(p)
            summary["verify"] = verify_all(p)[1]
        if prep:
            summary["bench"] = bench_step(p, prep)[1]
    finally:
        if prep is not None:
            prep.abandon()
    return finish(p, summary)


def finish(p: Pass, summary: dict) -> int:
    summary["steps"] = [asdict(s) for s in p.steps]
    summary["seconds"] = round(time.monotonic() - p.started, 1)
    summary["ok"] = all(s.status == "ok" for s in p.steps)
    (p.out / "pass.json").write_text(json.dumps(summary, indent=2) + "\n")
    p.say("summary:\n" + markdown(summary))
    cap_outputs(p.out)
    return 0 if summary["ok"] else 1


# --- workers (run by the pass in their own processes) -------------------------------------------

def make_fixtures(folder: Path, cases: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from family_fixtures import CASES, make_checkpoint

    by_id = {c.id: c for c in CASES}
    for case in cases:
        if not (folder / case / "config.json").is_file():
            make_checkpoint(by_id[case], folder / case)


def verify_worker(backend: str, device: str, dtypes: list[str], fixtures_dir: Path, cases: list[str],
                  out: Path) -> None:
    """`linnet verify`'s check for one backend over every case and dtype; one JSON line each."""
    from linnet_core.backends import get_backend
    from linnet_core.errors import BackendUnavailable, LinnetError
    from linnet_core.check.reference import load_reference
    from linnet_core.check.verify import verify

    with open(out, "a") as f:
        def emit(case: str, dtype: str, **fields) -> None:  # a verify report's own fields come first
            f.write(json.dumps({**fields.pop("report", {}), "backend": backend, "case": case, "dtype": dtype,
                                **fields}) + "\n")
            f.flush()

        for case in cases:
            reference = None
            for dtype in dtypes:
                try:
                    b = get_backend(backend)
                    b.check_device(device)  # first: "no CUDA provider" says more than "no CPU bf16 kernel"
                    b.check_available(dtype)
                    b.check_format(dtype)
                except BackendUnavailable as e:
                    emit(case, dtype, status="missing", reason=e.message + (f" ({e.hint})" if e.hint else ""))
                    continue
                try:
                    reference = reference or load_reference(fixtures_dir / case)
                    r = verify(fixtures_dir / case, backend, dtype, steps=8, reference=reference, device=device)
                    emit(case, dtype, status="passed" if r.passed else "failed", report=r.to_json())
                except LinnetError as e:
                    emit(case, dtype, status="error", reason=e.message)
                except Exception as e:  # noqa: BLE001 - a crash in one case is that case's result
                    emit(case, dtype, status="error", reason=crash_reason(e))


def crash_reason(e: BaseException) -> str:
    """The exception's first line and, where it wraps another's traceback (inductor's subprocess
    errors do), that traceback's last line: the cause."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    head = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return head if len(lines) < 2 else f"{head} ... {lines[-1]}"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "fixtures":
        make_fixtures(Path(sys.argv[2]), sys.argv[3:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "verify-worker":
        ap = argparse.ArgumentParser(prog="gpu_pass.py verify-worker")
        for name in ("--backend", "--device", "--dtypes", "--fixtures", "--cases", "--out"):
            ap.add_argument(name, required=True)
        a = ap.parse_args(sys.argv[2:])
        verify_worker(a.backend, a.device, a.dtypes.split(","), Path(a.fixtures), a.cases.split(","), Path(a.out))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default: $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, at test sizes")
    ap.add_argument("--budget", type=float, help="seconds for the whole pass (default: 480; dry run 420)")
    ap.add_argument("--work", help="scratch folder (default: /tmp/linnet-gpu-pass[-dry])")
    ap.add_argument("--steps", type=lambda v: v.split(","), default=list(STEPS),
                    help=f"some of {','.join(STEPS)} (a rerun of part of the pass; install always runs)")
    args = ap.parse_args()
    unknown = set(args.steps) - set(STEPS)
    if unknown:
        ap.error(f"unknown step {sorted(unknown)[0]!r} (choose from {', '.join(STEPS)})")
    if not args.out:
        ap.error("name the results folder with --out or $OUT")
    return main_pass(args)


if __name__ == "__main__":
    sys.exit(main())
