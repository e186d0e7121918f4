"""Mapping in a buffer's pages before a parallel write (consolidate.pages)."""

import mmap
import resource
import sys

import numpy as np
import pytest
import torch

from consolidate.pages import POPULATE_MIN_BYTES, populate, take_rows

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@linux
def test_populate_maps_the_pages_so_the_write_takes_no_faults():
    pages = (64 << 20) // mmap.PAGESIZE
    # torch's allocator asks for no huge pages (NumPy's does): one fault per 4 KiB page
    fresh = torch.empty(64 << 20, dtype=torch.uint8).numpy()  # a new mapping: none mapped
    before = _minor_faults()
    fresh.fill(1)
    unpopulated = _minor_faults() - before
    del fresh
    buf = torch.empty(64 << 20, dtype=torch.uint8).numpy()
    assert populate(buf)
    before = _minor_faults()
    buf.fill(1)
    populated = _minor_faults() - before
    assert unpopulated > 0.9 * pages  # the write faulted its pages in one by one ...
    assert populated < 0.01 * pages  # ... and none once they were mapped in first
    assert int(buf.sum(dtype=np.int64)) == 64 << 20


@linux
def test_populate_keeps_the_contents_and_takes_tensors():
    t = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB
    assert populate(t)
    assert populate(t.numpy())
    assert torch.equal(t, torch.arange(8 << 20, dtype=torch.float32))


def test_populate_leaves_small_read_only_and_strided_buffers_alone():
    assert not populate(np.zeros(POPULATE_MIN_BYTES // 8 - 1))  # under the minimum
    ro = np.zeros(POPULATE_MIN_BYTES)
    ro.flags.writeable = False
    assert not populate(ro)
    assert not populate(np.zeros((2, POPULATE_MIN_BYTES))[:, ::2])  # not contiguous
    assert not populate(torch.zeros((4, POPULATE_MIN_BYTES // 4)).t())


@pytest.mark.parametrize("rows", [5, 40_000])  # below and above the populate minimum
def test_take_rows_equals_index_select(rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn((50_000, 128), generator=g)
    idx = torch.randint(0, 50_000, (rows,), generator=g)
    want = x.index_select(0, idx)
    assert torch.equal(take_rows(x, idx), want)
    out = torch.full((rows, 128), float("nan"))
    got = take_rows(x, idx, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, want)
    assert torch.equal(take_rows(x.to(torch.int64), idx), want.to(torch.int64))


def test_take_rows_out_of_range_is_torchs_index_error():
    with pytest.raises(IndexError):
        take_rows(torch.zeros((3, 2)), torch.tensor([0, 3]))
