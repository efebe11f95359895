"""OpenMP thread pools when the steps run in another thread than the one that loaded the model.

Each thread that runs an OpenMP region keeps a pool of worker threads. When the pools together
hold more threads than there are CPUs, libgomp stops spin-waiting between regions and puts its
workers to sleep, so every one of the hundreds of small regions in a decode step pays a wake-up:
a serving engine's thread ran the `torch` backend's decode step 40% slower than the main thread
that had loaded the model (measured: 8 rows, 191M model, 45 ms against 32 ms).
"""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1
OPENMP_LIBS = ("libgomp", "libiomp", "libomp")


@functools.lru_cache(maxsize=None)
def _openmp_runtimes() -> tuple[ctypes.CDLL, ...]:
    """The OpenMP runtimes loaded in this process (PyTorch brings its own libgomp or libiomp)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().rsplit("/", 1)[-1].startswith(OPENMP_LIBS)}
    except OSError:  # not Linux: nothing to release
        return ()
    libs = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            libs.append(lib)
        except (OSError, AttributeError):  # not an OpenMP runtime, or one without OpenMP 5's pause
            continue
    return tuple(libs)


def release_openmp_pool() -> None:
    """Let the calling thread's OpenMP workers go (they come back if it runs a region again)."""
    for lib in _openmp_runtimes():
        lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
