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


def _loaded_libgomp() -> str | None:
    """Path of the libgomp this process has loaded (torch's own copy), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split()
        if fields and "libgomp" in Path(fields[-1]).name:
            return fields[-1]
    return None


def release_calling_thread_pool() -> bool:
    """Free the OpenMP helper threads of the calling thread (they exit; a later parallel region on this
    thread would start a new pool). False where there is no libgomp or it predates OpenMP 5.0."""
    path = _loaded_libgomp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(_OMP_PAUSE_SOFT) == 0
