"""The machine a benchmark ran on: CPU, cores, its vector and matrix units, library versions, load."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _native_bf16() -> bool | None:
    try:
        from pagedq_kernels.cpu import native_bf16
    except ImportError:
        return None
    return native_bf16()


# The CPU features that decide which kernels run (pagedq_kernels/cpu.py): a result without them cannot say why
# two machines of the same model name ran at different speeds (AMX tiles, say).
SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_features() -> list[str] | None:
    try:
        from pagedq_kernels.cpu import cpu_flags
    except ImportError:
        return None
    return [f for f in SIMD_FLAGS if f in cpu_flags()]


def machine_info(threads: int | None = None, device: str = "cpu") -> dict:
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_bf16": _native_bf16(),
        "cpu_features": cpu_features(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info
