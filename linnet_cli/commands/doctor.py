"""linnet doctor: what this machine can run; for what it cannot, why and what to install."""

from __future__ import annotations

from rich.markup import escape

from linnet_core.doctor import diagnose

from ..options import JsonOpt, QuietOpt
from ..output import Sink, handle_errors


@handle_errors
def doctor_command(json: JsonOpt = False, quiet: QuietOpt = False) -> None:
    """Python, PyTorch, GPU and driver, the optional toolchains (JAX, ONNX Runtime and its
    providers, TensorRT, llama.cpp bindings), the artifact cache, and every backend: ready, or the
    one-line reason and the install command."""
    from rich.table import Table

    sink = Sink(json, quiet)
    report = diagnose()
    payload = {section: [c.to_json() for c in checks] for section, checks in report.items()}
    if json or quiet:
        sink.data("", payload)
        return
    for section, checks in report.items():
        table = Table(title=section, title_justify="left", show_header=False, box=None, pad_edge=False)
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True)
        table.add_column()
        for c in checks:
            mark = "[green]ready[/]" if c.ready else "[yellow]not ready[/]"
            detail = escape(c.detail) + (f"\n[dim]{escape(c.fix)}[/]" if c.fix else "")
            table.add_row(f"  {escape(c.name)}", mark, detail)
        sink.out.print(table)
        sink.out.print()
