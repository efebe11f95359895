"""What structured output costs: the grammar's token mask per row and step, its share of a batched
decode step, and serving throughput with every request held to a JSON schema.

    python bench/grammar_mask.py /tmp/qwen3-191m                      # the model's own vocabulary
    python bench/grammar_mask.py /tmp/qwen3-191m --tokenizer llama.cpp/models/ggml-vocab-qwen2.gguf

1. The mask alone (xgrammar's fill, Linnet's unpacking onto the scores) for each vocabulary: the
   model's, padded to its logits' width, and `--tokenizer`'s (Qwen's 151,936 tokens from llama.cpp's
   vocabulary file), at 1 and 8 rows, stepping through a valid answer of SCHEMA token by token.
2. A decode step of 8 rows of the model, all free (greedy on the device) against all 8 held to SCHEMA,
   the two kinds of step taken in turn on their own rows: medians and their ratio.
3. `linnet serve` on the model, 64 requests at 8 in flight, unconstrained and constrained rounds in
   turn (the constrained ones as `linnet bench-serving --target http --request-fields` sends them):
   output tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from linnet_core.compile import load_model
from linnet_core.runtime.constraints import Constraint, GrammarSpec, grammars
from linnet_core.runtime.sampling import Sampler, SamplingParams
from linnet_core.serve.config import ServeConfig
from linnet_core.tokenizer import Tokenizer

# an answer never finished by random weights (its text unbounded), so every step pays a full mask
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "year", "tags"], "additionalProperties": False}
ANSWER = json.dumps({"title": "The Structure of Scientific Revolutions, second edition", "year": 1970,
                     "tags": ["history", "philosophy", "science", "paradigms"]})


def mask_cost(tok: Tokenizer, vocab_size: int, eos: set[int], rows: int) -> dict:
    book = grammars(tok, vocab_size, eos)
    compiled = book.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    answer = tok.encode(ANSWER, add_special_tokens=False)
    constraints = [Constraint(compiled) for _ in range(rows)]
    scores = torch.randn(vocab_size)
    steps = []
    for token in answer:
        start = time.perf_counter()
        for c in constraints:
            c.mask(scores)
        steps.append(time.perf_counter() - start)
        for c in constraints:
            c.accept(token)
    return {"vocab": vocab_size, "rows": rows, "answer_tokens": len(answer),
            "median_us": statistics.median(steps) * 1e6, "p90_us": sorted(steps)[int(0.9 * len(steps))] * 1e6}


def decode_share(model: str, dtype: str, tok: Tokenizer, steps: int) -> dict:
    rows = 8
    session, _ = load_model(model, "torch", dtype, cache_len=64 + steps + 2, rows=2 * rows)
    eos = tok.eos_ids
    compiled = grammars(tok, session.vocab_size, eos).compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    prompt = tok.encode("Name a book.")
    free_rows, held_rows = list(range(rows)), list(range(rows, 2 * rows))
    samplers = [Sampler(SamplingParams(grammar=compiled), prompt) for _ in held_rows]
    last = {}
    for r in free_rows + held_rows:
        sampler = samplers[r - rows] if r >= rows else None
        last[r] = session.prefill(prompt, slot=r, sampler=sampler).tokens[0]
    times = {"free": [], "held": []}
    for k in range(steps):
        for kind, group in (("free", free_rows), ("held", held_rows)):
            start = time.perf_counter()
            out = session.decode([last[r] for r in group], [len(prompt) + k] * rows, group,
                                 samplers=samplers if kind == "held" else None).tokens
            times[kind].append(time.perf_counter() - start)
            last.update(zip(group, out, strict=True))
    free, held = statistics.median(times["free"][5:]), statistics.median(times["held"][5:])
    return {"rows": rows, "steps": steps, "free_step_ms": free * 1e3, "held_step_ms": held * 1e3,
            "overhead": held / free - 1}


def serving(model: str, dtype: str, rounds: int) -> dict:
    from linnet_core.bench.serving.clients import run_http
    from linnet_core.bench.serving.targets import start_server
    from linnet_core.bench.serving.workload import Workload, round_trippable
    from linnet_core.compile import open_model

    workload = Workload(requests=64, prompt_min=32, prompt_max=128, new_tokens=64, concurrency=8)
    prompts = round_trippable(workload, open_model(model))
    config = ServeConfig(model, "torch", dtype, rows=8, cache_len=workload.longest_prompt + workload.new_tokens)
    proc, url = start_server(model, config)
    held = {"response_format": {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}}}
    out = {"free": [], "held": []}
    try:
        run_http(url, workload, prompts[:8])  # warm
        for r in range(rounds):
            for kind in (("free", "held") if r % 2 == 0 else ("held", "free")):
                fields = json.dumps(held) if kind == "held" else ""  # `linnet bench-serving --request-fields`'s
                results, wall = run_http(url, replace(workload, request_fields=fields), prompts)
                out[kind].append(sum(len(x.token_times) for x in results if x.ok) / wall)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    free, constrained = statistics.median(out["free"]), statistics.median(out["held"])
    return {"requests": workload.requests, "in_flight": 8, "new_tokens": workload.new_tokens, "rounds": out,
            "free_tok_s": free, "held_tok_s": constrained, "ratio": constrained / free}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokenizer", type=Path, help="a second vocabulary for the mask alone (a folder or GGUF file)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2, help="serving rounds of each kind")
    p.add_argument("--no-serving", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    tok = Tokenizer(Path(args.model))
    session_vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    figures = {"mask": [], "schema": SCHEMA}
    vocabularies = [(tok, session_vocab)]
    if args.tokenizer:
        other = Tokenizer(args.tokenizer)
        vocabularies.append((other, other.vocab_size))
    for t, v in vocabularies:
        for rows in (1, 8):
            row = mask_cost(t, v, t.eos_ids, rows)
            figures["mask"].append(row)
            print(f"mask, {v:,}-token vocabulary, {rows} row(s): {row['median_us']:.0f} us a step "
                  f"(p90 {row['p90_us']:.0f})")
    share = figures["decode"] = decode_share(args.model, args.dtype, tok, args.steps)
    print(f"decode step, 8 rows: free {share['free_step_ms']:.2f} ms, every row held to the schema "
          f"{share['held_step_ms']:.2f} ms (+{100 * share['overhead']:.1f}%)")
    if not args.no_serving:
        s = figures["serving"] = serving(args.model, args.dtype, args.rounds)
        print(f"serving, 8 in flight: free {s['free_tok_s']:.1f} tok/s, every request held to the schema "
              f"{s['held_tok_s']:.1f} tok/s ({s['ratio']:.3f}x)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
