"""The fuzz corpus of tests/gguf_corpus.py through the CLI, as a user meets it: every hostile file
refused in one line naming what is wrong (never "internal error", never a traceback) within 10 s and
512 MB over the process's baseline, or run as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from gguf_corpus import make  # noqa: E402

from linnet_core.export.gguf_export import export_gguf  # noqa: E402

BASES = ("qwen3-legacy-untied", "llama-gqa-untied")  # a byte-level BPE vocabulary and a SentencePiece one
SECONDS, MEMORY_MB = 10.0, 512

# One process for a whole corpus: its peak RSS over the baseline (after the good file has run)
# bounds every case's.
WORKER = textwrap.dedent('''
    import json, resource, sys, time
    from typer.testing import CliRunner
    from linnet_cli.app import app

    def run(path):
        started = time.perf_counter()
        r = CliRunner().invoke(app, ["run", path, "-p", "Hello there", "-n", "3"])
        return {"code": r.exit_code, "stderr": r.stderr, "stdout": r.stdout, "seconds": time.perf_counter() - started,
                "exception": None if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception)}

    def rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    base, cases = sys.argv[1], json.loads(sys.argv[2])
    out = {"base": run(base)}
    baseline = rss_mb()
    for name, path in cases.items():
        out[name] = run(path)
    out["memory_mb"] = rss_mb() - baseline
    print(json.dumps(out))
''')


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_every_hostile_gguf_is_refused_in_one_line_or_runs(base, tokenized_checkpoints, tmp_path):
    good = export_gguf(tokenized_checkpoints[base], tmp_path / "good.gguf", "f32", check=False).out
    corpus = make(good, tmp_path / "corpus")
    env = {k: v for k, v in os.environ.items() if k != "LINNET_DEBUG"} | {"LINNET_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", WORKER, str(good), json.dumps({n: str(p) for n, (p, _) in corpus.items()})],
                          capture_output=True, text=True, timeout=1800, env=env, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert results["base"]["code"] == 0, results["base"]
    problems = []
    for name, (path, expect) in corpus.items():
        r = results[name]
        text = r["stderr"] + r["stdout"]
        errors = [line for line in r["stderr"].splitlines() if line.startswith("error:")]
        if r["exception"] or "Traceback" in text or "internal error" in text:
            problems.append(f"{name}: {r['exception'] or text.strip()[:300]}")
        elif r["seconds"] > SECONDS:
            problems.append(f"{name}: {r['seconds']:.1f} s")
        elif expect == "runs" and r["code"] != 0:
            problems.append(f"{name}: should run, got {text.strip()[:300]}")
        elif expect.startswith("refused: ") and not (r["code"] == 1 and len(errors) == 1
                                                     and expect[len("refused: "):] in errors[0]):
            problems.append(f"{name}: should be refused naming {expect[9:]!r}, got {r['code']}: {text.strip()[:300]}")
    assert not problems, "\n".join(problems)
    assert results["memory_mb"] < MEMORY_MB, results["memory_mb"]
    # unknown keys change nothing a model computes
    assert results["unknown-keys-of-every-type"]["stdout"] == results["base"]["stdout"]
