"""Speculative decoding against plain decoding, side by side in one run: the cost of checking k
proposed tokens against a one-token step, and greedy decode speed with and without speculation
(the outputs compared token for token).

    python bench/speculative.py MODEL --dtype bf16 --speculate ngram              # prompt lookup
    python bench/speculative.py MODEL --dtype bf16 --draft MODEL --draft-dtype q4_0  # a q4_0 copy as draft
    python bench/speculative.py /tmp/seeds/qwen3-4b --dtype bf16 --draft /tmp/seeds/qwen3-0.6b --steps-only

MODEL defaults to the embedded model (trained: its text is real, so prompt lookup finds spans to
copy). The prompt is a passage the continuation repeats from (`--prompt copy`, the default) or
random token ids (`--prompt random`, for random-weight seeds). Prints a table; --save writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linnet_core.bench.machine import environment  # noqa: E402
from linnet_core.compile import load_model, open_model  # noqa: E402
from linnet_core.runtime.drafts import Draft  # noqa: E402
from linnet_core.runtime.generate import Generation  # noqa: E402
from linnet_core.runtime.session import Chunk  # noqa: E402
from linnet_core.speculation import SpeculationOptions, load_speculation  # noqa: E402
from linnet_core.tokenizer import Tokenizer  # noqa: E402

COPY_PROMPT = (ROOT / "bench" / "prompts" / "copy_edit.txt").read_text()  # `linnet bench --prompt-file` reads it too


def step_costs(session, prompt: list[int], ks: list[int], reps: int) -> dict:
    """Median seconds of a one-token decode step and of a check of k proposed tokens, at the same
    position after the prompt, interleaved; and the median ratio of each check to its neighbour step."""
    pos = len(prompt)
    token = session.prefill(prompt).tokens[0]
    times: dict[int, list[float]] = {0: [], **{k: [] for k in ks}}
    for _ in range(reps):
        for k in times:
            chunk = Chunk([token] * (k + 1), pos, 0, None, Draft((token,) * k)) if k else Chunk([token], pos, 0)
            t0 = time.perf_counter()
            session.step_tokens([chunk])
            times[k].append(time.perf_counter() - t0)
    one = statistics.median(times[0])
    # each rep's check against the one-token step just before it: this machine's bandwidth drifts by
    # half over minutes, which a ratio of medians taken over the whole run carries into the result
    return {"one_token_ms": one * 1e3,
            **{f"check_{k}_ms": statistics.median(times[k]) * 1e3 for k in ks},
            **{f"check_{k}_vs_one": statistics.median(t / o for t, o in zip(times[k], times[0])) for k in ks}}


def decode(session, prompt: list[int], new: int, runs: int, speculation=None) -> dict:
    """Greedy decode, median over runs: tok/s after the first token, and the tokens."""
    rates, tokens, stats = [], None, None
    for _ in range(runs):
        gen = Generation(session, prompt, new, speculation=speculation)
        tokens = list(gen)
        rates.append(gen.stats.decode_tok_s)
        stats = gen.speculative
    out = {"decode_tok_s": statistics.median(rates), "tokens": tokens}
    if speculation is not None:
        out.update(stats.to_json())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--speculate", choices=["ngram", "draft"])
    ap.add_argument("--draft")
    ap.add_argument("--draft-dtype", default="auto")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--fixed-draft", action="store_true")
    ap.add_argument("--prompt", choices=["copy", "random"], default="copy")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="with --prompt random")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20, help="timed steps per kind for the step costs")
    ap.add_argument("--steps-only", action="store_true", help="only the check's cost against a one-token step")
    ap.add_argument("--save", type=Path)
    a = ap.parse_args()

    m = open_model(a.model)
    if a.prompt == "copy":
        prompt = Tokenizer(m.path).encode(COPY_PROMPT)
    else:
        prompt = [(i * 7919) % (m.spec.vocab_size - 10) + 5 for i in range(a.prompt_tokens)]
    cache_len = len(prompt) + a.new_tokens + a.draft_tokens + 2
    session, compiled = load_model(m, a.backend, a.dtype, cache_len)
    result = {"model": m.resolved.name, "dtype": compiled.dtype, "backend": compiled.backend,
              "prompt_tokens": len(prompt), "environment": environment("cpu"),
              "steps": step_costs(session, prompt, [1, 2, 4, 8], a.reps)}
    print(f"{m.resolved.name} {compiled.backend} {compiled.dtype}: one-token step "
          f"{result['steps']['one_token_ms']:.2f} ms; check of k tokens: " +
          ", ".join(f"k={k} {result['steps'][f'check_{k}_vs_one']:.2f}x" for k in (1, 2, 4, 8)))
    if not a.steps_only:
        options = SpeculationOptions(a.speculate, a.draft, a.draft_tokens, not a.fixed_draft, None, a.draft_dtype)
        speculation, draft = load_speculation(options, compiled, session)
        plain = decode(session, prompt, a.new_tokens, a.runs)
        spec = decode(session, prompt, a.new_tokens, a.runs, speculation)
        result.update(proposer=f"draft {draft.model.resolved.name} {draft.dtype}" if draft else "prompt lookup",
                      plain=plain, speculative=spec, same_output=plain["tokens"] == spec["tokens"],
                      speedup=spec["decode_tok_s"] / plain["decode_tok_s"])
        print(f"{result['proposer']}: plain {plain['decode_tok_s']:.1f} tok/s, speculative "
              f"{spec['decode_tok_s']:.1f} tok/s ({result['speedup']:.2f}x); acceptance {spec['acceptance']:.2f}, "
              f"{spec['tokens_per_step']:.2f} tokens per target step; same output: {result['same_output']}")
    if a.save:
        a.save.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
