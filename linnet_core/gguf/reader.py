"""A defensive GGUF reader: every count, length, dimension and offset is checked before it is used.

GGUF parsers have a history of CVEs from malformed files (huge array or string lengths, tensor
dimensions whose product overflows, offsets past the end). Here each length is bounded by the
bytes actually left in the file before anything is allocated or looped over, so a malformed
file is refused with one line, in bounded memory and time. Tensor data is never copied: it is
a view of the memory-mapped file.
"""

from __future__ import annotations

import itertools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME, including the terminating zero in llama.cpp
MAX_STRINGS = 1 << 21  # per string array: ~8x the largest vocabulary or merge list in use (Gemma's 262k tokens)
MAX_ELEMENTS = 2**62  # per tensor: keeps every byte count far from int64 overflow
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> (name, struct format or None for string/array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# GGUF value type id -> the name errors and the metadata schema use
TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "string",
              10: "u64", 11: "i64", 12: "f64"}
# ggml tensor types Linnet knows: id -> (name, elements per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}


class GGUFError(CheckpointError):
    """A GGUF file that is malformed, truncated, or outside what Linnet reads."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major, outermost first (ggml's ne reversed)
    type: str
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF: `metadata` (key -> value; numeric arrays as numpy), `types` (key -> its GGUF type:
    "u32", "string", "array[f32]", ...) and `tensors` (name -> info). The values are as the file has
    them: `gguf.schema` checks what each means before Linnet uses it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = self.path.stat().st_size
                if size < 24:
                    raise GGUFError(f"{self.path}: not a GGUF file (only {size} bytes)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot be read ({e.strerror})") from None
        self._view = memoryview(self._map)
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.types: dict[str, str] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self._parse()

    # -- bounded primitive reads ------------------------------------------------------------
    def _fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: malformed GGUF: {what} (at byte {self._pos})")

    def _left(self) -> int:
        return len(self._map) - self._pos

    def _take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self._left():
            raise self._fail(f"{what} needs {n} bytes, {self._left()} are left")
        out = self._view[self._pos:self._pos + n]
        self._pos += n
        return out

    def _scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), what))[0]

    def _count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count, refused when that many items could not fit in the bytes left."""
        n = self._scalar("<Q", what)
        if n * min_item_bytes > self._left():
            raise self._fail(f"{what} is {n}, more than the {self._left()} bytes left can hold")
        return n

    def _string(self, what: str) -> str:
        n = self._count(f"length of {what}", 1)
        try:
            return bytes(self._take(n, what)).decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail(f"{what} is not UTF-8") from None

    def _strings(self, n: int, what: str) -> list[str]:
        """n strings at the cursor: `_string`'s checks in one loop (a vocabulary is ~150k of them)."""
        out, data, pos, end = [], self._map, self._pos, len(self._map)
        for i in range(n):
            length = struct.unpack_from("<Q", data, pos)[0] if end - pos >= 8 else None
            if length is None or length > end - pos - 8:
                self._pos = pos
                raise self._fail(f"{what}[{i}] runs past the end of the file")
            try:
                out.append(str(data[pos + 8:pos + 8 + length], "utf-8"))
            except UnicodeDecodeError:
                self._pos = pos
                raise self._fail(f"{what}[{i}] is not UTF-8") from None
            pos += 8 + length
        self._pos = pos
        return out

    def _value(self, vtype: int, what: str) -> tuple[Any, str]:
        """The value of GGUF type `vtype` at the cursor and its type's name."""
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype], what), TYPE_NAMES[vtype]
        if vtype == _STRING:
            return self._string(what), "string"
        if vtype != _ARRAY:
            raise self._fail(f"{what} has unknown value type {vtype}")
        etype = self._scalar("<I", f"element type of {what}")
        if etype in _SCALARS:
            fmt = _SCALARS[etype]
            n = self._count(f"length of {what}", struct.calcsize(fmt))
            raw = self._take(n * struct.calcsize(fmt), what)
            values = np.frombuffer(raw, dtype=np.dtype(fmt)).copy() if etype != 7 else \
                np.frombuffer(raw, dtype=np.uint8).astype(bool)
            return values, f"array[{TYPE_NAMES[etype]}]"
        if etype == _STRING:
            n = self._count(f"length of {what}", 8)  # each string has at least its u64 length
            if n > MAX_STRINGS:
                raise self._fail(f"{what} holds {n} strings, more than the {MAX_STRINGS} Linnet reads")
            return self._strings(n, what), "array[string]"
        if etype == _ARRAY:  # llama.cpp's reader takes none either; no key holds one
            raise self._fail(f"{what} is an array of arrays, which GGUF readers do not take")
        raise self._fail(f"{what} has unknown element type {etype}")

    # -- the file ---------------------------------------------------------------------------
    def _parse(self) -> None:
        if bytes(self._take(4, "magic")) != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = self._scalar("<I", "version")
        if self.version not in VERSIONS:
            raise self._fail(f"version {self.version} is not supported (supported: {VERSIONS})")
        # Minimal encodings: a tensor info is >= 8+1+4+8+4+8 bytes; a key/value >= 8+1+4+1.
        n_tensors = self._scalar("<Q", "tensor count")
        n_kv = self._scalar("<Q", "metadata count")
        if n_tensors * 33 > self._left() or n_kv * 14 > self._left():
            raise self._fail(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit in {self._left()} bytes")
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            if key in self.metadata:
                raise self._fail(f"metadata key '{key}' appears twice")
            self.metadata[key], self.types[key] = self._value(self._scalar("<I", f"type of '{key}'"), f"'{key}'")
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        kind = self.types.get("general.alignment", "u32")
        if kind not in ("u8", "u16", "u32", "u64") or alignment <= 0 or alignment & (alignment - 1):
            raise self._fail(f"general.alignment must be an unsigned integer power of two, "
                             f"holds the {kind} {str(alignment)[:40]}")
        infos = []
        for i in range(n_tensors):
            name = self._string(f"tensor name #{i}")
            if not name or len(name.encode()) >= MAX_NAME:
                raise self._fail(f"tensor name '{name[:80]}' is empty or longer than {MAX_NAME - 1} bytes")
            if name in self.tensors or any(name == t[0] for t in infos):
                raise self._fail(f"tensor '{name}' appears twice")
            n_dims = self._scalar("<I", f"dimension count of '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._fail(f"tensor '{name}' has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            ne = [self._scalar("<Q", f"dimension of '{name}'") for _ in range(n_dims)]
            ttype = self._scalar("<I", f"type of '{name}'")
            offset = self._scalar("<Q", f"offset of '{name}'")
            infos.append((name, ne, ttype, offset))
        data_start = -(-self._pos // alignment) * alignment
        data_size = len(self._map) - data_start
        if data_size < 0 and infos:  # a file of metadata alone (llama.cpp's vocab files) needs no padding
            raise self._fail("the file ends before its tensor data")
        spans = []
        for name, ne, ttype, offset in infos:
            if ttype not in GGML_TYPES:
                raise GGUFError(f"{self.path}: tensor '{name}' has unknown type {ttype}")
            tname, block, block_bytes = GGML_TYPES[ttype]
            elements = 1
            for d in ne:
                if d == 0 or d > MAX_ELEMENTS:
                    raise GGUFError(f"{self.path}: tensor '{name}' has dimension {d}")
                elements *= d
                if elements > MAX_ELEMENTS:
                    raise GGUFError(f"{self.path}: tensor '{name}' dimensions {ne} overflow")
            if ne[0] % block:
                raise GGUFError(f"{self.path}: tensor '{name}' rows of {ne[0]} are not whole {tname} blocks of {block}")
            nbytes = elements // block * block_bytes
            if offset % alignment or offset + nbytes > data_size:
                raise GGUFError(f"{self.path}: tensor '{name}' ({nbytes} bytes at data offset {offset}) is misaligned "
                                f"or runs past the end of the file ({data_size} data bytes)")
            spans.append((offset, offset + nbytes, name))
            self.tensors[name] = GGUFTensor(name, tuple(reversed(ne)), tname, data_start + offset, nbytes)
        spans.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise GGUFError(f"{self.path}: tensors '{a}' and '{b}' overlap")

    # -- tensor data ------------------------------------------------------------------------
    def raw(self, name: str) -> memoryview:
        t = self.tensors[name]
        return self._view[t.offset:t.offset + t.nbytes]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 (F32, F16, BF16 and Q8_0 are decoded here)."""
        t = self.tensors[name]
        raw = np.frombuffer(self.raw(name), dtype=np.uint8)
        if t.type == "F32":
            out = raw.view(np.float32).copy()
        elif t.type == "F16":
            out = raw.view(np.float16).astype(np.float32)
        elif t.type == "BF16":
            out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif t.type == "Q8_0":  # blocks of an f16 scale and 32 int8 values
            blocks = raw.reshape(-1, 34)
            scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            out = (blocks[:, 2:].copy().view(np.int8).astype(np.float32) * scale).reshape(-1)
        else:
            raise GGUFError(f"{self.path}: tensor '{name}' is {t.type}, which Linnet does not decode")
        return out.reshape(t.shape)

    def close(self) -> None:
        self._view.release()
        self._map.close()

    def __enter__(self) -> GGUFFile:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_gguf(path: Path) -> GGUFFile:
    return GGUFFile(path)
