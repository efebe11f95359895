"""The Typer app: it only assembles the commands (one module each)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from linnet_core import __version__

from .commands.bench import bench_command
from .commands.bench_serving import bench_serving_command
from .commands.cache import cache_app
from .commands.compile import compile_command
from .commands.doctor import doctor_command
from .commands.export import export_app
from .commands.models import models_command
from .commands.run import run_command
from .commands.serve import serve_command
from .commands.verify import verify_command

app = typer.Typer(
    name="linnet",
    help="Compile, run, verify, export and benchmark decoder-only LLM checkpoints on every stack, from one IR.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"linnet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Compile, run, verify, export and benchmark decoder-only LLM checkpoints on every stack, from one IR."""


app.command("compile")(compile_command)
app.command("run")(run_command)
app.command("verify")(verify_command)
app.add_typer(export_app, name="export")
app.command("bench")(bench_command)
app.command("bench-serving")(bench_serving_command)
app.command("serve")(serve_command)
app.command("doctor")(doctor_command)
app.command("models")(models_command)
app.add_typer(cache_app, name="cache")


def main() -> None:
    try:
        app()
    finally:
        # llama-cpp-python opens /dev/null twice at import and never closes it; at exit Python would
        # print a ResourceWarning about it under the command's output.
        utils = sys.modules.get("llama_cpp._utils")
        for name in ("outnull_file", "errnull_file"):
            getattr(getattr(utils, name, None), "close", lambda: None)()
