"""What every backend's artifact shares: its info and graph files, the prepared weights file,
generated modules imported by content, and the static-shape buckets of compiled steps."""

from __future__ import annotations

import hashlib
import json
import linecache
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import params as prepared
from ..ir.graph import Graph
from ..ir.verify import verify
from ..weights import Checkpoint, read_header, write_safetensors

if TYPE_CHECKING:
    from ..runtime.session import Session

WEIGHTS_FILE = "weights.safetensors"
ALIASES_KEY = "linnet.aliases"
FORMATS_KEY = "linnet.formats"  # {stored name: q8_0 | q4_0} of the block-quantized weights
MIN_PROMPT_BUCKET = 16


def write_artifact_info(out: Path, graph: Graph, dtype: str, cache_len: int, **extra: Any) -> None:
    """`artifact.json` (what a loader needs at once) and `graph.json` (the graph that was emitted)."""
    info = {
        "dtype": dtype,
        "cache_len": cache_len,
        "cache": vars(graph.cache),
        "vocab_size": graph.meta["spec"]["vocab_size"],
        "model_type": graph.meta["model_type"],
        "step": "ragged" if graph.ragged else "dense",
        **extra,
    }
    (out / "artifact.json").write_text(json.dumps(info, indent=2))
    (out / "graph.json").write_text(json.dumps(graph.to_json(), indent=1))


def read_info(artifact: Path) -> dict:
    return json.loads((artifact / "artifact.json").read_text())


def read_graph(artifact: Path) -> Graph:
    """The graph the artifact was emitted from, verified again: what was compiled is what is loaded."""
    graph = Graph.from_json(json.loads((artifact / "graph.json").read_text()))
    verify(graph)
    return graph


def write_prepared_weights(path: Path, graph: Graph, ckpt: Checkpoint, dtype: str) -> None:
    entries, aliases = prepared.layout(graph, dtype)
    metadata = {ALIASES_KEY: json.dumps(aliases), FORMATS_KEY: json.dumps(prepared.quantized_names(graph, dtype))}
    write_safetensors(path, entries, prepared.produce(graph, ckpt, dtype), metadata=metadata)


class PreparedWeights(dict):
    """{"global": {...}, "layers": [{...}, ...]} viewing a mapped prepared-weights file. A loader that
    copies or packs a tensor elsewhere calls `release(name)`, so its mapped original stops counting
    against the process's memory: the session then holds each weight once, not twice."""

    def __init__(self, groups: dict[str, Any], source: Checkpoint | None = None, aliases: dict[str, str] | None = None,
                 formats: dict[str, str] | None = None):
        super().__init__(groups)
        self._source, self._aliases, self._formats = source, aliases or {}, formats or {}

    def format_of(self, name: str) -> str | None:
        """The block format of a quantized weight (uint8 blocks; named as `release` names it), else None."""
        return self._formats.get(self._aliases.get(name, name))

    def release(self, name: str) -> None:
        """`name` as the file has it: global names as they are, block weights as blk.<i>.<name>."""
        if self._source is not None:
            self._source.release(self._aliases.get(name, name))

    def in_small_pages(self, name: str) -> None:
        """Map `name` (named as `release` names it) in 4 KiB pages: a table read by gathers."""
        if self._source is not None:
            self._source.in_small_pages(self._aliases.get(name, name))


def load_prepared_weights(path: Path, device: str) -> PreparedWeights:
    """The prepared weights, mapped from the file (not read) on CPU; on another device, copied there
    one tensor at a time, each mapped original released once copied."""
    ckpt = Checkpoint([path])
    aliases = json.loads(ckpt.metadata.get(ALIASES_KEY, "{}"))
    formats = json.loads(ckpt.metadata.get(FORMATS_KEY, "{}"))
    flat = {}
    for name in ckpt.tensors:
        flat[name] = ckpt.get(name) if device == "cpu" else ckpt.get(name).to(device)
        if device != "cpu":
            ckpt.release(name)
    return PreparedWeights(_grouped(flat, aliases), ckpt if device == "cpu" else None, aliases, formats)


def prepared_shapes(path: Path) -> dict[str, Any]:
    """The structure `load_prepared_weights` returns, with (shape, torch dtype, block format or None)
    in place of each tensor: read from the file's header alone (what a compile that needs no numbers
    takes)."""
    infos, metadata, _ = read_header(path)
    formats = json.loads(metadata.get(FORMATS_KEY, "{}"))
    return _grouped({name: (tuple(i.shape), i.dtype, formats.get(name)) for name, i in infos.items()},
                    json.loads(metadata.get(ALIASES_KEY, "{}")))


def _grouped(flat: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """{"global": {...}, "layers": [{...}, ...]} of flat file names (blk.<i>.<name> for blocks)."""
    flat = {**flat, **{alias: flat[target] for alias, target in aliases.items()}}
    layers: dict[int, dict[str, Any]] = {}
    glob: dict[str, Any] = {}
    for name, t in flat.items():
        if name.startswith("blk."):
            _, idx, local = name.split(".", 2)
            layers.setdefault(int(idx), {})[local] = t
        else:
            glob[name] = t
    return {"global": glob, "layers": [layers[i] for i in sorted(layers)]}


def flat_weights(graph: Graph, weights: dict[str, Any]) -> list[Any]:
    """The weights of `load_prepared_weights` as one list, in the graph's param order."""
    out = []
    for full, _, layer in graph.all_params():
        local = full if layer is None else full.split(".", 2)[2]
        out.append(weights["global"][local] if layer is None else weights["layers"][layer][local])
    return out


def import_generated(path: Path, prefix: str):
    """Import a generated module, named after its content.

    Name and code filename are the same in every process and folder, since compilers key their
    on-disk caches on them; the modules are stateless, so artifacts with one code share one.
    """
    source = path.read_bytes()
    name = f"{prefix}_{hashlib.sha256(source).hexdigest()[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__file__ = f"<linnet-generated>/{name}.py"
    code = compile(source, module.__file__, "exec")
    linecache.cache[module.__file__] = (len(source), None, source.decode().splitlines(True), module.__file__)
    sys.modules[name] = module  # compilers (dynamo) look functions' globals up by module name
    exec(code, module.__dict__)
    return module


def bucket(n: int, lowest: int, highest: int) -> int:
    """The power of two at or above n (at least `lowest`), capped at `highest` when n fits under it.
    Backends with static shapes compile one step per bucket of prompt length and of rows."""
    size = max(lowest, 1 << (n - 1).bit_length())
    return max(n, min(size, highest))


def warm_up(session: "Session") -> None:
    """Run the smallest prompt bucket and the one-row decode, so their compiled code lands in the
    artifact's caches at compile time."""
    session.prefill([0, 0])  # two tokens: one would take the decode shape
    session.decode([0], [2], [0])


def warm_up_shapes(cache_len: int) -> list[tuple[int, int]]:
    """The padded [B, T] steps `warm_up` runs: what a backend that compiles without running builds."""
    return [(1, bucket(2, MIN_PROMPT_BUCKET, cache_len)), (1, 1)]
