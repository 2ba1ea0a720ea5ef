"""Leave one OpenMP thread pool in the process: the engine thread's.

libgomp (the OpenMP runtime of torch's CPU wheels) gives every thread that opens a parallel region
its own pool of helper threads and counts the helpers of all pools together. Once that count is
above the number of CPUs it stops spinning between parallel regions (its "throttled" spin: 100
iterations) and parks the helpers on a futex, so each of the thousands of parallel regions in a step
pays a sleep and a wake-up. The worker loads and warms the model on its main thread and steps it on
the engine thread: two pools, and with 2 threads on 2 cores a served step took 30% to 40% longer than
the same step offline (`python -m ops.bench.serve_overhead ab off s1`). Freeing the loading thread's
pool (`omp_pause_resource_all`, OpenMP 5.0) before the engine thread starts keeps one.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

_OMP_PAUSE_SOFT = 1


def loaded_libgomps() -> list[str]:
    """Paths of every libgomp this process has mapped, in /proc/self/maps order. torch's own copy is one;
    a wheel that bundles another (sentencepiece does: `sentencepiece.libs/libgomp-*.so`) adds a second
    runtime with pools of its own, and it may come first."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths: list[str] = []
    for line in maps.splitlines():
        fields = line.split()
        if fields and "libgomp" in Path(fields[-1]).name and fields[-1] not in paths:
            paths.append(fields[-1])
    return paths


def release_calling_thread_pool() -> bool:
    """Free the OpenMP helper threads of the calling thread in every libgomp loaded (they exit; a later
    parallel region on this thread would start a new pool). Releasing only the first copy found left
    torch's pool alive once sentencepiece's copy was mapped before it, and served steps ran 50% slower
    (ops/bench/RESULTS.md). False where there is no libgomp or none has OpenMP 5.0's pause."""
    released = False
    for path in loaded_libgomps():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released = pause(_OMP_PAUSE_SOFT) == 0 or released
    return released
