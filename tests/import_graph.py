"""Linnet's own import graph, read from the source (no module is imported): every import of a
Linnet module, at the top of a file or inside a function, but not under `if TYPE_CHECKING:`
(never run). Used by test_architecture.py to keep the layering free of cycles."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

# Packages whose import costs seconds (or a GPU runtime): a light module may import a module that
# loads them inside the function that needs it, so `linnet --help` starts without them.
HEAVY = frozenset({"torch", "transformers", "jax", "jaxlib", "onnx", "onnxruntime", "tensorrt", "llama_cpp", "gguf",
                   "fastapi", "uvicorn", "accelerate"})


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # the deepest Linnet module the statement names
    line: int
    top_level: bool
    text: str  # the source line


class ImportGraph:
    def __init__(self, root: Path, packages: tuple[str, ...]):
        self.root, self.packages = root, packages
        self.files = {self._name(p): p for pkg in packages for p in (root / pkg).rglob("*.py")}
        self.imports = [imp for name in sorted(self.files) for imp in self._read(name)]

    def _name(self, path: Path) -> str:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def _known(self, dotted: str) -> str | None:
        while dotted not in self.files and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted if dotted in self.files else None

    def _read(self, name: str):
        path = self.files[name]
        source = path.read_text()
        tree, lines = ast.parse(source), source.splitlines()
        skipped = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
        top = {id(n) for n in tree.body}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] in self.packages and (known := self._known(target)) and known != name:
                    yield Import(name, known, node.lineno, id(node) in top, lines[node.lineno - 1])
                elif target.split(".")[0] not in self.packages:
                    yield Import(name, target.split(".")[0], node.lineno, id(node) in top, lines[node.lineno - 1])

    def edges(self) -> dict[str, list[Import]]:
        out: dict[str, list[Import]] = {name: [] for name in self.files}
        for imp in self.imports:
            if imp.target in self.files:
                out[imp.importer].append(imp)
        return out

    def cycles(self) -> list[list[str]]:
        """Strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
        edges = {name: [i.target for i in imps] for name, imps in self.edges().items()}
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []
        for start in edges:
            if start in index:
                continue
            work = [(start, iter(edges[start]))]
            index[start] = low[start] = len(index)
            stack.append(start)
            on_stack.add(start)
            while work:
                node, children = work[-1]
                child = next(children, None)
                if child is not None:
                    if child not in index:
                        index[child] = low[child] = len(index)
                        stack.append(child)
                        on_stack.add(child)
                        work.append((child, iter(edges[child])))
                    elif child in on_stack:
                        low[node] = min(low[node], index[child])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
        return found

    @functools.lru_cache(maxsize=None)
    def heavy(self, name: str) -> str | None:
        """The heavy package that importing `name` loads (through its top-level imports), or None."""
        seen, todo = {name}, [name]
        while todo:
            current = todo.pop()
            for imp in (i for i in self.imports if i.importer == current and i.top_level):
                if imp.target in HEAVY:
                    return imp.target
                parts = imp.target.split(".")  # importing a.b.c runs a and a.b first
                for module in (".".join(parts[:k]) for k in range(1, len(parts) + 1)):
                    if module in self.files and module not in seen:
                        seen.add(module)
                        todo.append(module)
        return None
