"""Shell completions and the man page, generated from the Typer app (never written by hand).

    python -m linnet_cli.docs          # rewrite completions/ and man/
    python -m linnet_cli.docs --check  # exit 1 when they are out of date (the tests run this)
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from typer._completion_shared import get_completion_script

from linnet_core import __version__

from .app import app

ROOT = Path(__file__).resolve().parent.parent
SHELLS = {"bash": "linnet.bash", "zsh": "_linnet", "fish": "linnet.fish"}
EXIT_STATUS = [
    ("0", "success (and, for verify, the backend is within tolerance)"),
    ("1", "failure: a model, checkpoint, cache or backend error, or bad input"),
    ("2", "usage error: an unknown option, or a value outside its choices"),
    ("3", "a check failed: verify past its tolerance, or an export's round trip"),
    ("130", "interrupted (Ctrl-C); nothing half-written is left in the cache"),
]
ENVIRONMENT = [
    ("LINNET_CACHE", "artifact cache folder (default: $XDG_CACHE_HOME/linnet)"),
    ("LINNET_DEBUG", "set to 1 to show tracebacks instead of one-line errors"),
    ("HF_HOME, HF_HUB_CACHE", "where Hugging Face checkpoints are cached"),
    ("HF_HUB_OFFLINE", "set to 1 to never reach the network"),
    ("NO_COLOR", "turn colours off"),
]


def completion(shell: str) -> str:
    return get_completion_script(prog_name="linnet", complete_var="_LINNET_COMPLETE", shell=shell)


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace("-", "\\-").replace("'", "\\(aq")


def _help(*args: str) -> str:
    """A command's --help text, as a person sees it at 80 columns without colour."""
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"})
    return result.stdout.rstrip() + "\n"


def man_page() -> str:
    root = typer.main.get_command(app)
    out = [
        f'.TH LINNET 1 "" "linnet {__version__}" "User Commands"',
        ".SH NAME",
        f"linnet \\- {_esc(root.help or '')}",
        ".SH SYNOPSIS",
        "\\fBlinnet\\fR [\\fB\\-\\-version\\fR] \\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIMODEL\\fR]",
        ".SH DESCRIPTION",
        "Linnet reads a decoder-only checkpoint in Hugging Face layout (a folder, a repo id or a short",
        "name), builds one IR from it, and compiles that IR for a backend; artifacts are cached on disk",
        "keyed by model, backend, dtype and cache length. Exports (Hugging Face safetensors, GGUF, ONNX)",
        "are loaded back in their consumer and checked against the source before they appear; bench",
        "measures every backend and the stacks they replace side by side.",
        ".SH COMMANDS",
    ]
    for name in root.commands:
        out += [f".SS linnet {name}", ".nf", _esc(_help(name)).rstrip(), ".fi"]
    out.append(".SH EXIT STATUS")
    for code, text in EXIT_STATUS:
        out += [".TP", f"\\fB{code}\\fR", _esc(text)]
    out.append(".SH ENVIRONMENT")
    for var, text in ENVIRONMENT:
        out += [".TP", f"\\fB{_esc(var)}\\fR", _esc(text)]
    out += [".SH EXAMPLES", ".nf",
            'linnet run \\-\\-prompt "The list object"',
            "linnet compile qwen3\\-4b \\-\\-backend torch \\-\\-dtype bfloat16",
            "linnet verify ./my\\-checkpoint \\-\\-dtype float16 || exit 1", ".fi"]
    return "\n".join(out) + "\n"


def generated() -> dict[Path, str]:
    files = {ROOT / "completions" / fname: completion(shell) for shell, fname in SHELLS.items()}
    files[ROOT / "man" / "linnet.1"] = man_page()
    return files


def main(argv: list[str]) -> int:
    stale = [p for p, text in generated().items() if not p.is_file() or p.read_text() != text]
    if "--check" in argv:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)} (run: python -m linnet_cli.docs)", file=sys.stderr)
        return 1 if stale else 0
    for p, text in generated().items():
        p.parent.mkdir(exist_ok=True)
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
