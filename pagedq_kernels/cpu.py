"""The CPU backend: a C++ extension with the decode attention kernel (csrc/cpu_decode.cpp), the
fused layer ops (csrc/cpu_fused.cpp, called from pagedq_kernels/fused.py) and a GEMM for the projections
(csrc/cpu_gemm.cpp, fp32 and bf16, called from worker/models/cpu_linear.py; bf16 on AMX tiles in
csrc/cpu_gemm_amx.cpp; weight-only int8 in csrc/cpu_gemm_int8.cpp), a prefill attention
(csrc/cpu_prefill.cpp), greedy sampling's argmax (csrc/cpu_sample.cpp) and a decoder layer that calls
those kernels from C++ (csrc/cpu_layer.cpp, used by worker/models/cpu_layer.py), plus the torch reference.
The GEMM and the attention kernels share their work between torch's threads through csrc/cpu_parallel.h:
a thread done with its share takes over the rest of a thread that lost its core to another process.

Decode is where a CPU engine spends its attention time, and it is bound by memory bandwidth: the
reference gathers each request's K/V rows into a buffer before two matmuls, which moves the cache
three times; the C++ kernel reads it once, straight from the blocks. It is compiled once with
torch's extension loader (g++ and ninja, one to a few minutes, cached under TORCH_EXTENSIONS_DIR,
~/.cache/torch_extensions by default; `python -m pagedq_kernels.build` builds it ahead of time, as the image
does) and used only when the build works: otherwise (no compiler, a file missing), or with
PAGEDQ_CPU_KERNEL=0, everything goes to the reference (and the model takes its plain, unfused path),
with one warning. Prefill chunks go through the C++ prefill kernel (csrc/cpu_prefill.cpp, AVX-512, fp32
and bf16) where it is built, else the torch reference.
The build targets what this CPU has (its /proc/cpuinfo flags): AVX-512,
with bf16 dot products where avx512_bf16 is (and the bf16 GEMM on AMX tiles where amx_bf16 is,
csrc/cpu_gemm_amx.cpp), else AVX2; PAGEDQ_CPU_AVX512=0 builds the AVX2 one
(whose projections then go through oneDNN: the extension's GEMM needs AVX-512).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

from pagedq_kernels.metadata import AttentionMetadata
from pagedq_kernels.reference import paged_attention_ref, prefill_ref

_CSRC = Path(__file__).with_name("csrc")
_SOURCE_NAMES = ("decode", "fused", "gemm", "gemm_int8", "gemm_amx", "prefill", "sample", "layer", "parallel")
SOURCES = [_CSRC / f"cpu_{name}.cpp" for name in _SOURCE_NAMES]
HEADERS = [
    _CSRC / name
    for name in (
        "cpu_vec.h",
        "cpu_decode_avx512.h",
        "cpu_avx512.h",
        "cpu_ops.h",
        "cpu_parallel.h",
        "cpu_amx.h",
        "cpu_prefill_amx.h",
    )
]
PREFILL_ENV = "PAGEDQ_CPU_PREFILL"  # 0: prefill chunks through the torch reference (an A/B switch)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the extension takes
_log = logging.getLogger("pagedq.kernels")
_lock = threading.Lock()
_ext = None  # the module, False when it cannot be built, None before the first try


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 `flags`, Arm `Features`); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware. Without it (plain AVX2, say) torch emulates bf16
    matmuls and they run tens of times slower than fp32, so bf16 is only worth its smaller size here."""
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & cpu_flags())


def _compile_flags(features: frozenset[str] | None = None, machine: str | None = None) -> list[str]:
    """g++ flags for a CPU with these feature flags (default: this CPU's)."""
    features = cpu_flags() if features is None else features
    machine = machine or platform.machine()
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]  # no FMA where torch multiplies, then adds
    if machine in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= features:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        wide = os.environ.get("PAGEDQ_CPU_AVX512", "1") != "0"  # 0: the AVX2 build (an A/B switch), no GEMM
        if wide and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= features:
            flags += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
            if "avx512_bf16" in features:
                flags.append("-mavx512bf16")
                if {"amx_tile", "amx_bf16"} <= features:  # the bf16 GEMM on AMX tiles
                    flags += ["-mamx-tile", "-mamx-bf16"]
    return flags


def build_name(flags: list[str]) -> str:
    """The extension's module name: a hash of the sources, the flags and torch's version, so a changed
    kernel, another CPU or another torch never loads a stale build."""
    text = "".join(source.read_text() for source in SOURCES + HEADERS)
    tag = hashlib.sha1((text + " ".join(flags) + torch.__version__).encode()).hexdigest()[:12]
    return f"pagedq_cpu_decode_{tag}"


def build_path(name: str) -> Path:
    """Where the built library of `name` lives: torch's extension cache (TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


def extension():
    """The compiled kernel module, or None when it is disabled or cannot be built (logged once)."""
    global _ext
    if _ext is None:
        with _lock:
            if _ext is None:
                _ext = _build()
    return _ext or None


def _build():
    if os.environ.get("PAGEDQ_CPU_KERNEL", "1") == "0":
        return False
    try:  # a missing source or header, no compiler, no ninja, an odd platform: the reference still works
        flags = _compile_flags()
        name = build_name(flags)
        cached = build_path(name)
        t0 = time.monotonic()
        compiled = not cached.exists()
        if compiled:
            _compile_into(cached, name, flags)
        module = _import(name, cached)
        how = f"compiled in {time.monotonic() - t0:.0f}s" if compiled else "prebuilt"
        _log.info("C++ CPU kernels in use (%s, %s, %s)", name, how, " ".join(f for f in flags if f.startswith("-m")))
        return module
    except Exception as e:
        _log.warning("C++ CPU kernels unavailable (%s); using the torch reference", e)
        return False


def _compile_into(target: Path, name: str, flags: list[str]) -> None:
    """Build in a private folder, then rename the library into the shared cache. torch's own loader
    serialises builders on a lock file that a process killed mid-build leaves behind for good; here
    concurrent builders each build alone, and the last rename (of identical files) wins."""
    import tempfile

    from torch.utils.cpp_extension import load

    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=tmp,
            verbose=False,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copyfile(Path(tmp) / target.name, staged)
        os.replace(staged, target)


def _import(name: str, path: Path):
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        query.dtype in DTYPES
        and k_cache.dtype == query.dtype
        and query.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and k_cache.stride(-2) == k_cache.shape[-1]
        and query.shape[1] % k_cache.shape[2] == 0
    )


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `paged_attention_ref`: decodes through the C++ decode kernel, prefill chunks
    through the C++ prefill kernel where it is built for the dtype and head size (AVX-512), else
    through the reference."""
    ext = extension()
    if ext is None or not supported(query, k_cache) or v_cache.stride() != k_cache.stride():
        return paged_attention_ref(query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, out=out)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    window = sliding_window if sliding_window and sliding_window > 0 else 0
    nd = meta.num_decodes
    if nd:
        ext.paged_decode(
            query[:nd],
            k_cache,
            v_cache,
            _int32(meta.block_tables[:nd]),
            _int32(meta.seq_lens[:nd]),
            out[:nd],
            float(scale),
            int(window),
        )
    if nd == meta.num_seqs:
        return out
    if os.environ.get(PREFILL_ENV, "1") != "0" and ext.prefill_supported(query):
        ext.paged_prefill(
            query,
            k_cache,
            v_cache,
            _int32(meta.block_tables[nd:]),
            _int32(meta.query_start_loc[nd:]),
            _int32(meta.seq_lens[nd:]),
            out,
            float(scale),
            int(window),
        )
    else:
        prefill_ref(query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, out=out)
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (int64), as `logits.max(dim=-1).indices`: through the extension's AVX-512
    kernel for CPU rows it takes (about 7x faster than torch's reduction on bf16), else through torch."""
    ext = extension() if logits.device.type == "cpu" else None
    if (
        ext is not None
        and logits.dtype in DTYPES
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(-1) == 1
        and ext.greedy_argmax_fast()
    ):
        return ext.greedy_argmax(logits)
    return logits.max(dim=-1).indices
