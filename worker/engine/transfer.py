"""Host <-> device traffic of a step, without stalling the host.

* `Uploader`: a step's input arrays go through pinned staging buffers, packed by dtype, one
  non-blocking copy per dtype; the step gets views of a device buffer that is reused (and grown,
  rarely). On the CPU the arrays are used in place (no copy at all).
* `to_device`: small per-step tensors (sampling parameters) through pinned memory, non-blocking.
* `to_host`: the sampler's results in one copy and one wait: the step's only device-to-host sync.
  Every call is counted in `HOST_READS` (on the CPU too, where the "sync" is the host reading the
  results), so tests and `pagedq bench host` can assert one per step.

Every view handed out starts on a 64-byte boundary: Triton specialises kernels on pointer alignment,
so an unaligned view would compile a kernel variant in the middle of serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

_ALIGN_BYTES = 64


@dataclass
class HostReads:
    """How many times the host has read a step's results (`to_host` calls) since the process started."""

    count: int = 0


HOST_READS = HostReads()


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """`t` (a host tensor) on `device`; to CUDA from pinned memory without blocking the host. The
    caching host allocator keeps the pinned block alive until the copy has completed."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Uploader:
    """Moves each step's host arrays to `device`; `copy=False` (the CPU) hands out the arrays themselves.

    `copy=True` on a CPU device exercises the staging logic without a GPU (tests)."""

    def __init__(self, device: torch.device, *, copy: bool | None = None) -> None:
        self.device = device
        self.copy = device.type != "cpu" if copy is None else copy
        self.pinned = device.type == "cuda"
        self._host: dict[np.dtype, Tensor] = {}
        self._device: dict[np.dtype, Tensor] = {}
        self._copied: torch.cuda.Event | None = None  # after the last copy out of the host buffers

    def upload(self, *arrays: np.ndarray) -> list[Tensor]:
        """Device tensors with the arrays' contents (1-D or 2-D, int32 / int64 / float32), in order."""
        if not self.copy:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the previous step's copies still read the host buffers (rare)
        layout: dict[np.dtype, int] = {}
        places = []
        for a in arrays:
            dt = a.dtype
            step = max(1, _ALIGN_BYTES // dt.itemsize)
            start = -(-layout.get(dt, 0) // step) * step
            places.append((dt, start))
            layout[dt] = start + a.size
        for dt, size in layout.items():
            self._reserve(dt, size)
            host = self._host[dt].numpy()
            for a, (adt, start) in zip(arrays, places):
                if adt == dt:
                    host[start : start + a.size] = a.reshape(-1)
            self._device[dt][:size].copy_(self._host[dt][:size], non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [self._device[dt][start : start + a.size].view(a.shape) for a, (dt, start) in zip(arrays, places)]

    def reserve(self, sizes: dict[type, int]) -> None:
        """Allocate the staging for the largest step now (elements per numpy dtype), not while serving."""
        if self.copy:
            for dt, size in sizes.items():
                self._reserve(np.dtype(dt), size + 64 * 16)  # + room for the alignment of up to 64 arrays

    def _reserve(self, dt: np.dtype, size: int) -> None:
        have = self._host.get(dt)
        if have is not None and have.numel() >= size:
            return
        size = max(size, 2 * have.numel() if have is not None else 1024)
        tdt = torch.from_numpy(np.zeros(0, dtype=dt)).dtype
        self._host[dt] = torch.empty(size, dtype=tdt, pin_memory=self.pinned)
        self._device[dt] = torch.empty(size, dtype=tdt, device=self.device)


def to_host(tensors: list[Tensor | None]) -> list[Tensor | None]:
    """The tensors on the CPU, with one device-to-host copy and one wait for the lot (None stays None).

    int64 tensors go first in the packed buffer, then 4-byte ones, so every part stays aligned."""
    HOST_READS.count += 1
    present = [t for t in tensors if t is not None]
    if not present or present[0].device.type == "cpu":
        return list(tensors)
    order = sorted(range(len(present)), key=lambda i: -present[i].element_size())
    flat = [present[i].reshape(-1).view(torch.uint8) for i in order]
    packed = flat[0] if len(flat) == 1 else torch.cat(flat)
    host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    wait(done)
    parts: list[Tensor | None] = [None] * len(present)
    offset = 0
    for i, f in zip(order, flat):
        t = present[i]
        parts[i] = host[offset : offset + f.numel()].view(t.dtype).view(t.shape)
        offset += f.numel()
    it = iter(parts)
    return [None if t is None else next(it) for t in tensors]


def wait(event: torch.cuda.Event) -> None:
    """The step's one host wait (a seam for the tests that count them)."""
    event.synchronize()
