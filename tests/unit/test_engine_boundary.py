"""The engine's narrow surface: outside worker/engine/, code reads `engine.snapshot()` and
`engine.limits`, never the scheduler, the KV manager or the model runner (they live on the engine
thread; reading them from another thread races with it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INTERNALS = {"scheduler", "kv", "runner", "scheduler_config", "stats"}
INTERNAL_MODULES = {"worker.engine.scheduler", "worker.engine.kv_cache", "worker.engine.model_runner"}
# Diagnostics of the engine's own parts, not users of the engine: the GPU check inspects the runner's
# CUDA graphs, the KV-waste bench simulates the block allocator on its own, and the serving-overhead
# profile and the host-work bench time the runner's forward inside each engine step.
EXEMPT = {"ops/bench/gpu_check_speed.py", "ops/bench/kv_waste.py", "ops/bench/serve_overhead.py", "ops/bench/host.py"}


def _sources():
    for top in ("worker", "producer_sdk", "pagedq_kernels", "ops"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("worker/engine/") or rel in EXEMPT:
                continue
            yield rel, ast.parse(path.read_text(), rel)


def _engine_like(node: ast.expr) -> bool:
    text = ast.unparse(node)
    return text.split(".")[-1] in ("engine", "eng", "_engine")


def test_no_code_outside_the_engine_reads_its_internals():
    found = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in INTERNALS and _engine_like(node.value):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and node.module in INTERNAL_MODULES:
                found.append(f"{rel}:{node.lineno}: from {node.module} import ...")
    assert not found, "engine internals used outside worker/engine:\n" + "\n".join(found)


def test_the_check_finds_what_it_should():
    tree = ast.parse("x = self.engine.kv.num_blocks\ny = eng.scheduler.running\nz = engine.snapshot()\n")
    hits = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in INTERNALS and _engine_like(n.value)]
    assert [ast.unparse(h) for h in hits] == ["self.engine.kv", "eng.scheduler"]
