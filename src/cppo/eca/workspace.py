"""A reusable scratch buffer for the executor's temporaries on CPU.

Fresh large CPU tensors are page-faulted in on first touch (about 3 GB/s here, against 17 GB/s for
writing warm memory), which made the executor's many temporaries cost more than its additions.
Temporaries are therefore carved, stack-wise, out of one flat buffer per (dtype, device) that is
kept between calls (per thread). Results handed back to callers are never taken from it.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch

_local = threading.local()


class Arena:
    """Stack allocator over one flat tensor; grows (at the next outermost scope) when too small."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.tops: dict[tuple, int] = {}
        self.needed: dict[tuple, int] = {}
        self.depth = 0

    def take(self, shape, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` with `like`'s dtype and device."""
        if like.device.type != "cpu":  # other devices have caching allocators of their own
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        key = (like.dtype, like.device)
        size, top = math.prod(shape), self.tops.get(key, 0)
        self.tops[key] = top + size
        self.needed[key] = max(self.needed.get(key, 0), top + size)
        buffer = self.buffers.get(key)
        if buffer is None or top + size > buffer.numel():
            return torch.empty(shape, dtype=like.dtype, device=like.device)  # too small: grows later
        return buffer[top : top + size].view(shape)

    @contextlib.contextmanager
    def scope(self):
        """Everything taken inside the block is given back at its end."""
        if self.depth == 0:
            for key, needed in self.needed.items():
                if key not in self.buffers or self.buffers[key].numel() < needed:
                    self.buffers[key] = torch.empty(needed, dtype=key[0], device=key[1])
        saved = dict(self.tops)
        self.depth += 1
        try:
            yield self
        finally:
            self.depth -= 1
            self.tops = saved


def arena() -> Arena:
    """This thread's arena."""
    if not hasattr(_local, "arena"):
        _local.arena = Arena()
    return _local.arena


def release_workspace() -> None:
    """Free this thread's scratch memory (it is allocated again on the next call)."""
    _local.arena = Arena()
