"""Memory pages of large buffers: mapping them in ahead of a parallel write.

A fresh buffer from ``torch.empty`` or ``np.empty`` of more than a few hundred KiB is a new
anonymous mapping: each 4 KiB page is mapped in by a page fault the first time it is
written. When several threads (torch's intra-op pool) write such a buffer at once, their
faults contend on the process's page-table locks. On the 2-core benchmark machine (a
virtual machine) a gather of 10^6 rows of 384 float32 into a fresh 1.5 GB buffer took
2.0-2.5 s, nearly all of it in the kernel; with the pages mapped in first by one
``madvise(MADV_POPULATE_WRITE)`` call (Linux 5.14 and later, ``madvise(2)``), 0.44 s to map
plus 0.22 s to gather.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np
import torch

__all__ = ["madvise", "populate", "take_rows"]

#: ``madvise`` advice value of ``MADV_POPULATE_WRITE`` (Linux ``include/uapi/asm-generic/mman-common.h``)
MADV_POPULATE_WRITE = 23

#: buffers below this many bytes are left alone (their faults are few)
POPULATE_MIN_BYTES = 16 << 20

_MADVISE: list[Any] = []


def madvise() -> Any | None:
    """libc's ``madvise(addr, length, advice) -> int`` through ctypes (``errno`` kept), or
    ``None`` where the C library has none (not Linux/glibc-like)."""
    if not _MADVISE:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _MADVISE.append(fn)
    return _MADVISE[0]


def populate(buf: Any) -> bool:
    """Map in the whole pages that lie inside ``buf`` for writing, in one system call, before
    it is written (:data:`MADV_POPULATE_WRITE`). The contents are not changed: a page already
    mapped is left as it is.

    Args:
        buf: a C-contiguous NumPy array or CPU ``torch.Tensor`` (any dtype) that this process
            may write; CUDA tensors and buffers under :data:`POPULATE_MIN_BYTES` are left
            alone.

    Returns:
        Whether the pages were mapped in (``False`` where the kernel or C library lacks the
        call, the buffer is too small or not on the CPU; the buffer is then faulted in by its
        first write as usual).
    """
    if hasattr(buf, "data_ptr"):  # torch.Tensor
        if buf.device.type != "cpu" or not buf.is_contiguous():
            return False
        addr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    else:
        arr = np.asarray(buf)
        if not arr.flags.c_contiguous or not arr.flags.writeable:
            return False
        addr, nbytes = arr.ctypes.data, arr.nbytes
    fn = madvise()
    if fn is None or nbytes < POPULATE_MIN_BYTES:
        return False
    page = mmap.PAGESIZE
    lo = -(-addr // page) * page
    hi = (addr + nbytes) // page * page
    return hi > lo and fn(lo, hi - lo, MADV_POPULATE_WRITE) == 0


def take_rows(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.index_select(0, rows)``, into ``out`` if given; on the CPU the output's pages are
    mapped in first (:func:`populate`), so torch's threads do not fault them in one by one.

    Args:
        x: ``[n, ...]`` tensor (any dtype, any device).
        rows: ``int64 [k]`` row positions on ``x``'s device.
        out: ``[k, ...]`` contiguous tensor of ``x``'s dtype on its device, or ``None``.

    Returns:
        ``[k, ...]``: ``out`` or a new tensor.

    Raises:
        IndexError: a position outside ``[0, n)`` (torch's error).
    """
    if x.device.type != "cpu":
        return x.index_select(0, rows) if out is None else torch.index_select(x, 0, rows, out=out)
    if out is None:
        out = torch.empty((len(rows), *x.shape[1:]), dtype=x.dtype)
    populate(out)
    return torch.index_select(x, 0, rows, out=out)
