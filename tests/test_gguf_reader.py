"""The GGUF reader against malformed files: each refused with one clear line, fast, in bounded memory."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

from linnet_core.errors import CheckpointError
from linnet_core.gguf.reader import GGUFError, read_gguf

U32, U64, STRING, ARRAY, F32 = 4, 10, 8, 9, 6


def s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, value: int) -> bytes:
    return s(key) + struct.pack("<I", U32) + struct.pack("<I", value)


def tensor_info(name: str, dims: list[int], ttype: int = 0, offset: int = 0) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) \
        + struct.pack("<II", ttype, 0)[:4] + struct.pack("<Q", offset)


def gguf(kvs: list[bytes] = (), infos: list[bytes] = (), data: bytes = b"", n_tensors=None, n_kv=None,
         magic=b"GGUF", version=3) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    body += b"\0" * (-len(body) % 32)
    return body + data


GOOD = gguf([kv_u32("general.alignment", 32), s("general.architecture") + struct.pack("<I", STRING) + s("llama")],
            [tensor_info("a.weight", [4, 2]), tensor_info("b.weight", [8], offset=32)],
            data=np.arange(8, dtype=np.float32).tobytes() + np.ones(8, dtype=np.float32).tobytes())


def write(tmp_path, raw: bytes):
    path = tmp_path / "m.gguf"
    path.write_bytes(raw)
    return path


def test_a_well_formed_file_reads(tmp_path):
    with read_gguf(write(tmp_path, GOOD)) as g:
        assert g.metadata["general.architecture"] == "llama" and g.version == 3
        assert g.tensors["a.weight"].shape == (2, 4)  # ggml's dims reversed: rows, then columns
        assert np.array_equal(g.tensor("a.weight"), np.arange(8, dtype=np.float32).reshape(2, 4))
        assert np.array_equal(g.tensor("b.weight"), np.ones(8, dtype=np.float32))


HUGE = 2**63
MALFORMED = {
    "truncated in the header": (GOOD[:60], "cannot fit"),
    "truncated in a tensor's info": (GOOD[:len(GOOD) - 64 - 40], "needs"),
    "truncated data": (GOOD[:-4], "runs past the end"),
    "bad magic": (b"GGML" + GOOD[4:], "not a GGUF file"),
    "tiny file": (b"GGUF", "not a GGUF file"),
    "version": (gguf(version=99), "version 99"),
    "tensor count": (gguf(n_tensors=HUGE), "cannot fit"),
    "metadata count": (gguf(n_kv=2**40), "cannot fit"),
    "string length": (gguf([struct.pack("<Q", HUGE) + b"key"]), "more than the"),
    "array length 2^63": (gguf([s("tokens") + struct.pack("<II", ARRAY, U32) + struct.pack("<Q", HUGE)]),
                          "length of 'tokens' is 9223372036854775808"),
    "string array length": (gguf([s("tokens") + struct.pack("<II", ARRAY, STRING) + struct.pack("<Q", 2**62)]),
                            "more than the"),
    "nested arrays": (gguf([s("a") + struct.pack("<II", ARRAY, ARRAY) + struct.pack("<Q", 1) + struct.pack("<I", ARRAY)
                            + struct.pack("<Q", 1) + struct.pack("<I", ARRAY) + struct.pack("<Q", 1)]), "array of arrays"),
    "string array past the cap": (gguf([s("t") + struct.pack("<II", ARRAY, STRING) + struct.pack("<Q", 2**21 + 1)
                                        + s("a") * (2**21 + 1)]), "more than the 2097152"),
    "a string of an array past the end": (gguf([s("t") + struct.pack("<II", ARRAY, STRING) + struct.pack("<Q", 2)
                                                + s("a") + struct.pack("<Q", 2**40)]), "runs past the end"),
    "alignment as a bool": (gguf([s("general.alignment") + struct.pack("<I", 7) + b"\x01"]), "holds the bool"),
    "alignment as a string": (gguf([s("general.alignment") + struct.pack("<I", STRING) + s("32")]), "holds the string"),
    "unknown value type": (gguf([s("k") + struct.pack("<I", 77) + b"\0" * 16]), "unknown value type 77"),
    "unknown array type": (gguf([s("k") + struct.pack("<II", ARRAY, 55) + struct.pack("<Q", 1)]),
                           "unknown element type 55"),
    "duplicate key": (gguf([kv_u32("k", 1), kv_u32("k", 2)]), "appears twice"),
    "not utf-8": (gguf([struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<II", U32, 1)]), "not UTF-8"),
    "alignment": (gguf([kv_u32("general.alignment", 24)]), "power of two"),
    "dims overflow": (gguf(infos=[tensor_info("t", [2**32, 2**32, 2**32])], data=b"\0" * 64), "overflow"),
    "zero dim": (gguf(infos=[tensor_info("t", [0, 4])], data=b"\0" * 64), "dimension 0"),
    "too many dims": (gguf(infos=[tensor_info("t", [1] * 5)], data=b"\0" * 64), "5 dimensions"),
    "unknown tensor type": (gguf(infos=[tensor_info("t", [4], ttype=99)], data=b"\0" * 64), "unknown type 99"),
    "partial block": (gguf(infos=[tensor_info("t", [16], ttype=8)], data=b"\0" * 64), "not whole Q8_0 blocks"),
    "offset past the end": (gguf(infos=[tensor_info("t", [4], offset=2**40)], data=b"\0" * 64), "past the end"),
    "misaligned offset": (gguf(infos=[tensor_info("t", [4], offset=3)], data=b"\0" * 64), "misaligned"),
    "overlap": (gguf(infos=[tensor_info("t", [8]), tensor_info("u", [8])], data=b"\0" * 64), "overlap"),
    "duplicate tensor": (gguf(infos=[tensor_info("t", [4]), tensor_info("t", [4], offset=32)], data=b"\0" * 64),
                         "appears twice"),
    "long name": (gguf(infos=[tensor_info("t" * 70, [4])], data=b"\0" * 64), "longer than"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_files_are_refused_clearly(case, tmp_path):
    raw, message = MALFORMED[case]
    path = write(tmp_path, raw)
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(GGUFError) as err:
        read_gguf(path)
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    text = str(err.value)
    assert message in text and "\n" not in text and str(path) in text
    assert isinstance(err.value, CheckpointError)  # the CLI's one-line error, exit 1
    assert elapsed < 1.0 and peak < 1 << 20  # refused up front: no loop over a claimed count, no big buffer
