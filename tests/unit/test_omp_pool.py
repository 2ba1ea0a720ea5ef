"""Freeing a thread's OpenMP helpers (worker/engine/omp_pool.py), in a fresh interpreter so the test
process's own thread pools are left alone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, os, threading, time
    import torch
    from worker.engine.omp_pool import release_calling_thread_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settle(want, timeout=10.0):
        deadline = time.monotonic() + timeout
        while threads() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return threads()

    torch.set_num_threads(3)
    x = torch.randn(1 << 21)
    ref = float((x * 2).sum())  # a parallel region on this thread: its pool has 2 helpers now
    with_pool = threads()
    released = release_calling_thread_pool()
    after_release = settle(with_pool - 2)
    box = {}

    def engine():
        box["sum"] = float((x * 2).sum())  # the other thread's pool: 2 helpers of its own
        box["threads"] = threads()

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    again = float((x * 2).sum())  # this thread may still compute: a new pool
    print(json.dumps(dict(released=released, with_pool=with_pool, after_release=after_release,
                          in_thread=box["threads"], same=[ref == box["sum"], ref == again])))
    """
)


def test_release_frees_the_calling_threads_helpers_and_leaves_torch_working():
    env_script = [sys.executable, "-c", SCRIPT]
    done = subprocess.run(env_script, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["released"] is True
    assert r["after_release"] == r["with_pool"] - 2  # both helpers exited
    assert r["in_thread"] == r["with_pool"] + 1  # the second thread plus its own 2 helpers, no more
    assert r["same"] == [True, True]


SECOND_RUNTIME = textwrap.dedent(
    """
    import ctypes, json, os, shutil, sys, time
    import torch
    from worker.engine.omp_pool import loaded_libgomps, release_calling_thread_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    [torch_gomp] = loaded_libgomps()
    copy = os.path.join(sys.argv[1], "libgomp-bundled.so.1")  # another wheel's own copy, as sentencepiece ships
    shutil.copyfile(torch_gomp, copy)
    ctypes.CDLL(copy)
    torch.set_num_threads(3)
    x = torch.randn(1 << 21)
    float((x * 2).sum())  # a pool in torch's runtime: 2 helpers
    with_pool = threads()
    released = release_calling_thread_pool()
    deadline = time.monotonic() + 10
    while threads() != with_pool - 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    print(json.dumps(dict(runtimes=len(loaded_libgomps()), released=released, freed=with_pool - threads())))
    """
)


def test_release_frees_torchs_pool_when_another_libgomp_is_loaded(tmp_path):
    done = subprocess.run([sys.executable, "-c", SECOND_RUNTIME, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["runtimes"] == 2 and r["released"] is True
    assert r["freed"] == 2  # torch's helpers exited, whichever copy /proc/self/maps lists first
