"""linnet run: generate text from a prompt, streamed to stdout; timings to stderr."""

from __future__ import annotations

import json as jsonlib
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from linnet_core.errors import InputError
from linnet_core.tokenizer import IncrementalDecoder, Tokenizer

from ..options import (AdaptiveDraftOpt, BackendName, BackendOpt, CacheLenOpt, DraftBackendOpt, DraftDtypeOpt, DraftOpt,
                       DraftTokensOpt, DtypeOpt, JsonOpt, OptionalModelArg, QuietOpt, RevisionOpt, SpeculateOpt)
from ..output import Sink, handle_errors


@handle_errors
def run_command(
    model: OptionalModelArg = None,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue (or the user message with --chat).")] = ...,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Sample among the k likeliest (0 = all).")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling, for repeatable output.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Apply the checkpoint's chat template.")] = False,
    json_schema: Annotated[Optional[Path], typer.Option(
        "--json-schema", help="Hold the output to this JSON schema (a file).", show_default=False)] = None,
    regex: Annotated[Optional[str], typer.Option(
        help="Hold the output to this regular expression.", show_default=False)] = None,
    grammar: Annotated[Optional[Path], typer.Option(
        "--grammar", help="Hold the output to this grammar (a file: GBNF, or Lark where it has no '::=').",
        show_default=False)] = None,
    logprobs: Annotated[Optional[int], typer.Option(
        "--logprobs", min=0, max=20, help="Report each token's log-probability and the N likeliest "
                                          "(stderr; with --json, in the result).", show_default=False)] = None,
    backend: BackendOpt = BackendName.torch,
    dtype: DtypeOpt = "auto",
    cache_len: CacheLenOpt = None,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
    draft_tokens: DraftTokensOpt = 4,
    adaptive_draft: AdaptiveDraftOpt = True,
    draft_backend: DraftBackendOpt = None,
    draft_dtype: DraftDtypeOpt = "auto",
    revision: RevisionOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Generate from MODEL (default: the embedded model), streaming text as it is chosen."""
    # The core (and torch) load here, not at CLI start-up, so --help and completion stay fast.
    from linnet_core.compile import load_model, open_model  # imports torch: not at start-up
    from linnet_core.runtime.generate import Generation  # imports torch: not at start-up
    from linnet_core.runtime.constraints import grammars  # imports torch: not at start-up
    from linnet_core.runtime.sampling import Sampler, SamplingParams  # imports torch: not at start-up
    from linnet_core.speculation import SpeculationOptions, load_speculation  # imports torch: not at start-up

    sink = Sink(json, quiet)
    wanted = SpeculationOptions(speculate, draft, draft_tokens, adaptive_draft,  # checked before anything loads
                                draft_backend.value if draft_backend else None, draft_dtype)
    m = open_model(model, revision)
    tok = Tokenizer(m.path)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    if not ids:
        raise InputError("the prompt encodes to no tokens")
    t0 = time.perf_counter()
    session, compiled = load_model(m, backend.value, dtype, cache_len, progress=sink.info)
    speculation, drafted = load_speculation(wanted, compiled, session, progress=sink.info)
    load_s = time.perf_counter() - t0
    eos = tok.eos_ids | set(m.spec.eos_token_ids)
    spec = output_constraint(json_schema, regex, grammar)
    held = grammars(tok, session.vocab_size, eos).compile(spec) if spec else None
    sampler = Sampler(SamplingParams(temperature, top_p, top_k, seed, logprobs=logprobs, grammar=held), ids)
    gen = Generation(session, ids, max_new_tokens, sampler, stop_ids=eos, speculation=speculation)
    decoder = IncrementalDecoder(tok)
    stream, scored = not json, []
    for token in gen:
        delta = decoder.push(token)
        if logprobs is not None:
            scored.append(sampler.take_logprobs())
        if stream and delta:
            sys.stdout.write(delta)
            sys.stdout.flush()
    tail = decoder.flush()
    st = gen.stats
    if stream:
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
    if logprobs is not None and not json and not quiet:
        for lp in scored:
            top = "  ".join(f"{_piece(tok, t)} {v:.3f}" for t, v in lp.top)
            sys.stderr.write(f"{_piece(tok, lp.token)}\t{lp.logprob:.4f}" + (f"\t{top}" if top else "") + "\n")
    state = "cached" if compiled.hit else "compiled"
    spec = gen.speculative
    proposer = f"draft {drafted.model.resolved.name} {drafted.dtype}" if drafted else "prompt lookup"
    sink.info(
        f"[dim]{st.prompt_tokens} prompt tokens · {st.new_tokens} new ({st.finish_reason}) · "
        f"first token {st.ttft_s * 1000:.0f} ms · {st.decode_tok_s:.1f} tok/s · "
        f"{compiled.backend} {compiled.dtype} · load {load_s:.2f} s ({state})[/]"
        + (f"\n[dim]speculative ({proposer}): {spec.accepted} of {spec.proposed} proposed tokens accepted "
           f"({spec.acceptance:.0%}) · {spec.tokens_per_step:.2f} tokens per target step[/]" if speculation else "")
    )
    if json:
        sink.data("", {
            "text": tok.decode(decoder.ids), "tokens": decoder.ids, "prompt_tokens": st.prompt_tokens,
            "new_tokens": st.new_tokens, "finish_reason": st.finish_reason, "ttft_s": st.ttft_s,
            "decode_tok_s": st.decode_tok_s, "load_s": load_s, "backend": compiled.backend,
            "dtype": compiled.dtype, "cache_hit": compiled.hit, "model": m.resolved.name,
            **({"speculative": {"proposer": "draft" if drafted else "ngram", **spec.to_json()}} if speculation else {}),
            **({"logprobs": [{"token": lp.token, "text": _piece(tok, lp.token), "logprob": lp.logprob,
                              "top": [{"token": t, "text": _piece(tok, t), "logprob": v} for t, v in lp.top]}
                             for lp in scored]} if logprobs is not None else {}),
        })


def _piece(tok: Tokenizer, token: int) -> str:
    return tok.token_bytes(token).decode("utf-8", errors="replace")


def output_constraint(json_schema: Path | None, regex: str | None, grammar: Path | None):
    """The GrammarSpec of --json-schema / --regex / --grammar (one at most), or None."""
    from linnet_core.runtime.constraints import GrammarSpec, grammar_kind  # imports torch: not at start-up

    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise InputError(f"{given[0]} and {given[1]} both constrain the output: give one")
    if regex is not None:
        return GrammarSpec("regex", regex)
    for path, option in ((json_schema, "--json-schema"), (grammar, "--grammar")):
        if path is None:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{option} {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
        if option == "--grammar":
            return GrammarSpec(grammar_kind(text), text)
        try:
            jsonlib.loads(text)
        except ValueError:
            raise InputError(f"{option} {path}: not valid JSON") from None
        return GrammarSpec("json_schema", text)
    return None
