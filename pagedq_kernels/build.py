"""Build the C++ CPU kernels ahead of time: `python -m pagedq_kernels.build [--all-isas]`.

A worker builds the extension for its CPU on first use (under a minute, cached in torch's extension
folder, TORCH_EXTENSIONS_DIR). An image built once and run on many machines builds every x86 variant
here instead, so no worker compiles at start, whatever CPU it lands on: each variant's module name
hashes its compiler flags, and a worker loads the one its CPU's flags select.
Exits non-zero when a build fails, so an image build stops rather than ship the torch reference.
Each variant compiles for minutes on two cores (about 5 on a busy 2-core machine): an image built on the
host that runs it (`docker compose up --build`) needs only the native one; `--all-isas` is for images
pushed to a registry and run on other CPUs.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

# Feature sets that select each x86 build of `cpu._compile_flags`, from the plainest up.
X86_VARIANTS: dict[str, frozenset[str]] = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}),
    "avx512_bf16": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"}),
    "amx": frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
    ),
}


def variants(all_isas: bool) -> dict[str, list[str]]:
    """Compiler flags by variant name: this CPU's only, or every x86 level (on x86)."""
    from pagedq_kernels import cpu

    if not all_isas or platform.machine() not in ("x86_64", "AMD64"):
        return {"native": cpu._compile_flags()}
    return {label: cpu._compile_flags(features, "x86_64") for label, features in X86_VARIANTS.items()}


def build(flags: list[str]) -> tuple[str, bool]:
    """Compile one variant into the cache unless it is there; returns its module name and whether it
    was compiled now."""
    from pagedq_kernels import cpu

    name = cpu.build_name(flags)
    path = cpu.build_path(name)
    if path.exists():
        return name, False
    cpu._compile_into(path, name, flags)
    return name, True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedq_kernels.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--all-isas", action="store_true", help="every x86 variant, not only this CPU's")
    args = parser.parse_args(argv)
    from pagedq_kernels import cpu

    todo = variants(args.all_isas)
    for i, (label, flags) in enumerate(todo.items(), 1):
        t0 = time.monotonic()
        try:
            name, compiled = build(flags)
        except Exception as e:
            print(f"[{i}/{len(todo)}] {label}: build failed: {e}", file=sys.stderr, flush=True)
            return 1
        what = f"built in {time.monotonic() - t0:.0f}s" if compiled else "already built"
        print(f"[{i}/{len(todo)}] {label}: {what} ({cpu.build_path(name)})", flush=True)
    if cpu.extension() is None:  # this CPU's own variant must load, or the worker would fall back
        print("this CPU's kernels do not load (see the warning above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
