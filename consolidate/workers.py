"""Forked worker processes for the pass's pure text rules.

The conflict guard (:func:`~consolidate.ops.guard.conflict_between` over
:func:`~consolidate.ops.guard.conflict_signature`) and a model-free merger with the fidelity
checker (:mod:`consolidate.ops.fidelity`) are pure Python functions of texts that hold the GIL:
threads cannot share them out. :func:`fork_map` runs the parts of such a job in processes
forked from the pass, which read the pass's memory as it was at the fork (nothing is
pickled on the way in) and send back only their answers (reasons, merged texts). The
calling process works on the first part meanwhile, and every process then takes the next
part nobody has taken (tokens in a pipe), so a process slowed by its machine
or by copy-on-write faults takes fewer parts. Every part is computed by the same
functions as inline, so the answers are the same whatever the number of processes and
whichever process computes a part.

Where ``fork`` is not a start method (Windows), or with one worker, the parts run inline.
A forked process never touches torch, CUDA or I/O: it computes, sends, and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import multiprocessing
import os
import pickle
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from .environment import usable_cpus

__all__ = [
    "resolve_workers",
    "fork_map",
    "split_evenly",
    "work_parts",
    "PARTS_PER_WORKER",
    "WorkerError",
    "peak_private_bytes",
    "FirstTouch",
]

T = TypeVar("T")

#: the most private memory (bytes) a forked worker of this process held when it answered
_PEAK_PRIVATE = [0]


def peak_private_bytes() -> int:
    """The most memory, in bytes, that one forked worker of this process held of its own
    when it answered (``Private_Clean + Private_Dirty`` of ``/proc/self/smaps_rollup``: the
    pages it wrote or read in, not those it still shares with this process); 0 if none
    has run or the system does not say. Benchmarks add it to this process's peak."""
    return _PEAK_PRIVATE[0]


def _private_bytes() -> int:
    """This process's private memory in bytes (Linux), else 0."""
    total = 0
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


class WorkerError(RuntimeError):
    """A forked worker failed (its traceback is in the message) or died without an
    answer."""


def resolve_workers(workers: int | None) -> int:
    """The number of processes a pass's text rules may use: ``workers``, or the CPUs this
    process may run on (:func:`~consolidate.environment.usable_cpus`) when ``None``; 1 where
    processes cannot be forked.

    Raises:
        ValueError: ``workers`` below 1.
    """
    if workers is not None and (isinstance(workers, bool) or int(workers) < 1):
        raise ValueError(f"text workers must be an integer >= 1 or None, got {workers!r}")
    n = usable_cpus() if workers is None else int(workers)
    if n > 1 and "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return n


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``range(n)``, sizes differing
    by at most one (empty ranges dropped)."""
    cuts = np.linspace(0, n, max(1, parts) + 1).round().astype(np.int64).tolist()
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


#: parts per process that :func:`work_parts` cuts a job into: enough that the process that
#: ends first finds parts left (at most about one part's time of imbalance), few enough
#: that a part's fixed costs do not count
PARTS_PER_WORKER = 8


def work_parts(workers: int) -> int:
    """How many parts to cut a job for ``workers`` processes into: 1 inline,
    :data:`PARTS_PER_WORKER` per process otherwise (:func:`fork_map` hands them out)."""
    return 1 if workers <= 1 else workers * PARTS_PER_WORKER


#: the most tokens a :class:`_Dispenser` puts in its pipe (4 bytes each: 4 KiB, which fits
#: any pipe's buffer, so filling it never blocks)
_MAX_TOKENS = 1024


class _Dispenser:
    """Hands out the parts ``1..n-1`` in order, each to the process that asks first.

    A pipe filled before the fork with one 4-byte token per run of ``step`` parts (one
    part per token up to :data:`_MAX_TOKENS` parts), its write end closed at once: each
    ``read`` of 4 bytes takes one token whole (a pipe read of bytes that are there is one
    step under the pipe's lock), and an empty pipe reads as its end. No lock is held
    between reads, so a process killed at any point leaves the others able to go on."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.step = max(1, -(-(n - 1) // _MAX_TOKENS))
        tokens = np.arange(1, n, self.step, dtype="<u4").tobytes()
        r, w = os.pipe()
        try:
            if os.write(w, tokens) != len(tokens):
                raise OSError("the parts' tokens did not fit in a pipe")
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self.fd = r

    def taken(self) -> Iterator[int]:
        """The parts this process takes, one run of ``step`` parts at a time, until none is
        left."""
        while True:
            got = os.read(self.fd, 4)
            if not got:
                return
            a = int.from_bytes(got, "little")
            yield from range(a, min(self.n, a + self.step))

    def close(self) -> None:
        os.close(self.fd)


def _child(fn: Callable[[Any], Any], parts: Sequence[Any], left: _Dispenser, conn: Any) -> None:
    """A forked worker's body: the parts it takes from ``left`` until none is left, then
    their answers ``[(part, answer), ...]`` (or the failed part and its traceback) down the
    pipe."""
    done: list[tuple[int, Any]] = []
    k = -1
    try:
        for k in left.taken():
            done.append((k, fn(parts[k])))
        k = -1
        out = pickle.dumps(("ok", done, _private_bytes()), pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        where = f"part {k}" if k >= 0 else f"its answers to parts {[j for j, _ in done]}"
        out = pickle.dumps(("error", (where, traceback.format_exc()), 0))
    conn.send_bytes(out)
    conn.close()


#: ``madvise`` advice values (Linux): a range is not mapped in, or again mapped in, a child;
#: pages are mapped in writable without being touched (Linux 5.14+)
_MADV_DONTFORK, _MADV_DOFORK, _MADV_POPULATE_WRITE = 10, 11, 23


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise(address, length, advice) -> 0 | -1`` (errno kept), or ``None`` where
    there is no such libc (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """``(lo, hi)``: the bytes ``[lo, hi)`` of the whole pages inside ``[address, address +
    nbytes)`` (``lo == hi`` when there is none); a page it shares with other memory is left
    out."""
    page = mmap.PAGESIZE
    lo = -(-address // page) * page
    return lo, max(lo, (address + nbytes) // page * page)


@contextlib.contextmanager
def _not_forked(arrays: Sequence[np.ndarray]) -> Iterator[None]:
    """While open, the whole pages of each array are not mapped into forked children
    (``madvise(MADV_DONTFORK)``, undone on exit): the fork copies no page tables for them,
    and this process's later writes to them take no copy-on-write faults. A child must not
    read them (it would fault). A no-op where ``madvise`` is missing or refuses."""
    done = []
    madvise = _libc_madvise()
    for a in arrays if madvise is not None else ():
        if a is None or not a.nbytes:
            continue
        lo, hi = _whole_pages(a.ctypes.data, a.nbytes)
        if hi - lo >= 16 * mmap.PAGESIZE and madvise(lo, hi - lo, _MADV_DONTFORK) == 0:
            done.append((lo, hi - lo))
    try:
        yield
    finally:
        for lo, n in done:
            madvise(lo, n, _MADV_DOFORK)


def fork_map(
    fn: Callable[[Any], T],
    parts: Sequence[Any],
    workers: int,
    not_shared: Sequence[np.ndarray] = (),
) -> list[T]:
    """``[fn(p) for p in parts]`` in this process and up to ``workers - 1`` forked ones.

    This process computes the first part while the children start; then each process
    takes the next part nobody has taken, in order, until none is left (:class:`_Dispenser`),
    so the work evens out when one process runs slower (the other load on
    its core, the copy-on-write faults of a fork). Give several parts per worker for that
    to help. Which process computes a part does not change its answer.

    ``fn`` and the parts are not pickled (the children are forks); each answer is, so
    answers should be small (strings, numbers). ``fn`` must not write files, use torch or
    change state the caller reads afterwards: a child's writes stay in the child.

    Args:
        fn: a pure function of one part.
        parts: the parts, in order.
        workers: processes in all, this one included (1 = inline).
        not_shared: large arrays ``fn`` never reads (the pass's vectors): left out of the
            children's memory (:func:`_not_forked`), which makes the fork and this
            process's later writes to them cheaper.

    Returns:
        The answers in the order of ``parts``.

    Raises:
        WorkerError: a part failed in a child (the part and its traceback are in the
            message), a child's answers could not be pickled there or loaded here, or a
            child died without an answer. A part that fails in this process raises its own
            exception; the children are then killed and reaped.
    """
    if not isinstance(parts, Sequence):
        parts = list(parts)
    if workers <= 1 or len(parts) <= 1:
        return [fn(p) for p in parts]
    with _not_forked(not_shared):
        return _forked(fn, parts, min(workers, len(parts)))


#: a part no process has answered yet
_MISSING = object()


def _forked(fn: Callable[[Any], T], parts: Sequence[Any], workers: int) -> list[T]:
    """:func:`fork_map`'s forks: ``workers - 1`` children; the first part here, then
    every process takes the next part left."""
    ctx = multiprocessing.get_context("fork")
    n = len(parts)
    out: list[Any] = [_MISSING] * n
    left = _Dispenser(n)  # part 0 is this process's
    running = []
    try:
        with warnings.catch_warnings():
            # Python 3.12 warns on fork in a threaded process (torch's pools): the child
            # runs pure Python and exits, it takes no lock a thread may hold
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*fork")
            for c in range(1, workers):
                recv, send = ctx.Pipe(duplex=False)
                # not a daemon, so that a part may fork_map in turn (joined below)
                proc = ctx.Process(target=_child, args=(fn, parts, left, send))
                proc.start()
                send.close()
                running.append((c, proc, recv))
        out[0] = fn(parts[0])
        for k in left.taken():
            out[k] = fn(parts[k])
        for c, proc, recv in running:
            for k, value in _answer(c, workers, proc, recv):
                out[k] = value
    finally:
        left.close()
        for _, proc, recv in running:  # first stop every child (SIGKILL: never ignored) ...
            recv.close()
            if proc.exitcode is None:
                proc.kill()
        for _, proc, _ in running:  # ... then reap them
            proc.join()
    missing = [k for k, v in enumerate(out) if v is _MISSING]
    if missing:  # a claimed part always comes back, or its worker raised above
        raise WorkerError(f"parts {missing} of {n} came back from no worker")
    return out


def _answer(c: int, n: int, proc: Any, recv: Any) -> list[tuple[int, Any]]:
    """Child ``c``'s answers ``[(part, answer), ...]`` from its pipe, or
    :class:`WorkerError`."""
    try:
        got = recv.recv_bytes()
    except EOFError:
        proc.join()
        raise WorkerError(
            f"text worker {c} of {n} died without an answer (exit code {proc.exitcode})"
        ) from None
    try:
        status, value, private = pickle.loads(got)
    except Exception as e:  # noqa: BLE001 - an answer that does not load here
        raise WorkerError(f"text worker {c} of {n} sent answers that do not load: {e!r}") from e
    if status != "ok":
        where, tb = value
        raise WorkerError(f"text worker {c} of {n} failed on {where}:\n{tb}")
    _PEAK_PRIVATE[0] = max(_PEAK_PRIVATE[0], private)
    return value


#: bytes per step of :class:`FirstTouch` (its thread checks for :meth:`FirstTouch.join`
#: between steps)
FIRST_TOUCH_STEP = 32 << 20


class FirstTouch:
    """Map in the first ``nbytes`` of a fresh array in a background thread: the page faults
    of its first fill are taken on a core the caller leaves idle meanwhile, not by the
    caller's later write.

    A fresh allocation's pages are mapped in by the first write to each (a minor fault:
    1-2 us a page on a quiet machine, 3-20 us on a virtual machine whose host took the
    memory back; 0.4-0.6 s for 1.5 GB on the 2-core benchmark machine). Two ways, chosen
    when the object is made:

    * ``populate`` (Linux 5.14 and later): ``madvise(MADV_POPULATE_WRITE)`` maps the whole
      pages of the range in writable without writing them, in steps of
      :data:`FIRST_TOUCH_STEP` bytes from the end of the range towards its start. It writes
      nothing, and a page that is mapped in already keeps its contents, so the caller may
      read and write the array while the thread runs (:attr:`writes` is ``False``); a
      caller that fills the array from its start meets the thread somewhere in the middle,
      each having mapped in its own part. (The kernel maps 1.5 GB in about a quarter
      faster this way than by touching each page: 0.87 s against 1.15 s on the 2-core
      machine.)
    * ``zero`` (elsewhere): the thread writes zeros (``memset``, which releases the GIL) in
      steps from the start. Nobody may read or write the array's first ``nbytes`` until
      :meth:`join` returns (:attr:`writes` is ``True``).

    The thread holds a reference to the array while it runs. :meth:`join` stops the thread
    after its current step (the caller's own writes map in the rest). An exception in the
    thread is dropped: the caller's writes then map the pages in as they would have
    without it.

    Args:
        array: a C-contiguous, writeable array that owns fresh memory (e.g.
            ``torch.empty(...).numpy()``, which keeps the tensor alive); in ``zero`` mode its
            first ``nbytes`` bytes are overwritten with zeros.
        nbytes: how many of its first bytes to map in (``int``).
        populate: ``None`` (default): ``populate`` where the kernel has it, else ``zero``;
            ``False``: ``zero``; ``True``: ``populate`` or :class:`OSError`.

    Raises:
        ValueError: ``array`` is not C-contiguous or not writeable, or ``nbytes`` is
            negative or larger than ``array.nbytes``.
        OSError: ``populate=True`` where ``madvise(MADV_POPULATE_WRITE)`` fails.
    """

    def __init__(self, array: np.ndarray, nbytes: int, populate: bool | None = None) -> None:
        nbytes = int(nbytes)
        if not array.flags.c_contiguous:
            raise ValueError("FirstTouch needs a C-contiguous array")
        if not array.flags.writeable:
            raise ValueError("FirstTouch needs a writeable array")
        if not 0 <= nbytes <= array.nbytes:
            raise ValueError(f"FirstTouch of {nbytes} bytes of an array of {array.nbytes}")
        self._array = array
        self._stop = threading.Event()
        page = mmap.PAGESIZE
        address = array.ctypes.data
        lo, hi = _whole_pages(address, nbytes)
        self._madvise = None if populate is False else _libc_madvise()
        if self._madvise is None and populate:
            raise OSError("madvise(MADV_POPULATE_WRITE) is not available here")
        # one page now: the kernel answers EINVAL where it has no such advice (a range
        # without a whole page has nothing to map in: no probe, nothing to do)
        if (
            self._madvise is not None
            and hi > lo
            and self._madvise(hi - page, page, _MADV_POPULATE_WRITE) != 0
        ):
            err = ctypes.get_errno()
            if populate:
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE) failed: errno {err}")
            self._madvise = None
        #: whether the thread writes the array (``zero`` mode): see the class docstring
        self.writes = self._madvise is None
        run, args = (self._zero, (address, nbytes)) if self.writes else (self._map, (lo, hi))
        self._thread = threading.Thread(target=run, args=args, daemon=True)
        self._thread.start()

    def _zero(self, address: int, nbytes: int) -> None:
        with contextlib.suppress(Exception):
            for a in range(0, nbytes, FIRST_TOUCH_STEP):
                if self._stop.is_set():
                    return
                ctypes.memset(address + a, 0, min(FIRST_TOUCH_STEP, nbytes - a))

    def _map(self, lo: int, hi: int) -> None:
        madvise = self._madvise
        assert madvise is not None
        with contextlib.suppress(Exception):
            for b in range(hi, lo, -FIRST_TOUCH_STEP):
                if self._stop.is_set():
                    return
                a = max(lo, b - FIRST_TOUCH_STEP)
                if madvise(a, b - a, _MADV_POPULATE_WRITE) != 0:
                    return  # e.g. out of memory: the caller's writes map the rest in

    @property
    def done(self) -> bool:
        """Whether the thread has ended (mapped in every step, stopped, or failed)."""
        return not self._thread.is_alive()

    def join(self) -> None:
        """Stop after the current step and wait for the thread (idempotent)."""
        self._stop.set()
        self._thread.join()
