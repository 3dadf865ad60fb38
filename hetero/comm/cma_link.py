"""The link of one group for [Note: collectives by cross-memory attach] (`cma.py`): the system calls, the blocks the
ranks post in, and the worker that runs the group's operations in the order they were issued."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hetero.comm.cma_calls import copy as _copy
from hetero.comm.cma_calls import fault_in as _fault_in
from hetero.comm.cma_calls import libc as _libc
from hetero.errors import CollectiveMismatchError

logger = logging.getLogger("hetero.comm")

# A rank's block, int64 each: its posted sequence number, its input's address, its size in bytes and what it is (kind,
# op, dtype: `_code`), then one slot per rank of the group, where that rank writes the last operation it finished
# reading from this one.
_SEQ, _ADDR, _NBYTES, _CODE, _DONE = 0, 1, 2, 3, 4
_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# What the transport carries (`cma.start`): the dtypes whose reductions torch computes on a CPU as gloo does.
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DTYPES = (*_FLOATS, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_OPS = ("sum", "avg", "max", "min")


def _block(size: int) -> Any:
    return (ctypes.c_int64 * (_DONE + size))()


def _code(kind: str, op: str, dtype: torch.dtype) -> int:
    """What an operation posts beside its input, for its peers to compare with theirs (`_describe` reads it)."""
    return (_KINDS.index(kind) * len(_OPS) + _OPS.index(op)) * len(DTYPES) + DTYPES.index(dtype)


def _describe(code: int, nbytes: int) -> str:
    (kind, op), dtype = divmod(code // len(DTYPES), len(_OPS)), str(DTYPES[code % len(DTYPES)]).removeprefix("torch.")
    return f"{_KINDS[kind]}{'' if kind == 0 else f' ({_OPS[op]})'} of {nbytes} bytes of {dtype}"


_LOOK_S = 0.05  # a waiting worker looks at its peers' blocks at least this often, poked or not
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF)


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> int | None:
    """Our pid namespace: a pid names the same process only within one. Containers on one host share the boot id
    (and, with the host's network, the abstract sockets) but not their pids: there a peer's pid may be our own."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _stores_in_order() -> bool:
    """Whether this CPU makes a thread's stores visible to other cores in program order (x86's TSO), which `_post`
    relies on: the address, then the sequence number, each a plain store. Python has no fence to make weaker
    orderings (Arm's, POWER's) safe, so there gloo moves the data."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _allow_peers() -> None:
    """Under Yama's "restricted" ptrace scope only a process's ancestors may read it; ranks are siblings, so each
    names any process of its user as allowed (what MPI libraries do for the same copies). Scopes 2 and 3 forbid
    it outright: the probe then fails and gloo moves the data."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        return
    if scope == "1":
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def _wake_socket() -> socket.socket | None:
    """[Note: waking a waiting rank]
    A worker waiting for a peer's post or "done" blocks on a datagram socket of its own, and every post and "done"
    sends each peer one byte: no core spins while a peer computes (spinning with sched_yield cost 6% of a rank's
    samples in the ZeRO-3 race, on two cores both computing). The socket's name is in Linux's abstract namespace
    (a leading NUL): it has no file, so a killed job leaves nothing behind."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(f"\0hetero-cma-{os.getpid()}-{os.urandom(6).hex()}".encode())
        return sock
    except (OSError, AttributeError):
        return None


class Work:
    """A submitted operation: `wait(timeout)` blocks until every rank finished it (as a backend's work does)."""

    def __init__(self, what: str, run: Callable[[], None]) -> None:
        self.what, self._run = what, run
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self, broken: str | None) -> BaseException | None:
        """Run it (the link's worker), unless an earlier operation of the group failed; returns its error."""
        try:
            if broken is not None:
                raise RuntimeError(f"an earlier collective of this group failed ({broken})")
            self._run()
        except BaseException as err:  # the waiter raises it
            self._error = err
        self._run = None  # type: ignore[assignment]  # drop the tensors now: see [Note: letting the groups go]
        self._done.set()
        return self._error

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if not self._done.wait(seconds):
            raise RuntimeError(f"{self.what} timed out after {seconds} s (cross-memory transport)")
        if self._error is not None:
            kind = CollectiveMismatchError if isinstance(self._error, CollectiveMismatchError) else RuntimeError
            raise kind(str(self._error)) from self._error
        return True


class Link:
    """The transport of one group: its ranks' processes and blocks, and the worker that runs its operations."""

    def __init__(
        self, *, rank: int, pids: list[int], blocks: list[int], block: Any, wake: socket.socket, wakes: list[bytes]
    ) -> None:
        self.rank, self.size, self.pids, self.blocks, self.wakes = rank, len(pids), pids, blocks, wakes
        self.peers = [(rank + i) % self.size for i in range(1, self.size)]  # staggered: not all at rank 0 first
        self._block = block  # ours: peers read it, so it lives as long as the link
        self._wake = wake
        self._peek_buf = (ctypes.c_int64 * _DONE)()  # a peer's seq, address, size and code
        self._scratches: dict[int, torch.Tensor] = {}  # used by the worker thread only
        self._seq = 0
        self._submitting = threading.Lock()
        self._broken: str | None = None
        self._stop = False
        self._queue: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="hetero-cma", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ opening
    @classmethod
    def open(cls, comm: Any, *, wanted: bool = True) -> Link | None:
        """Collective over `comm`'s ranks: a link if all want one, share the host and can read each other, else None.
        `wanted` is each rank's own setting (`HETERO_CPU_TRANSPORT`): agreed here, like the rest, so that a rank
        launched with another setting than its peers makes them all use gloo instead of leaving them waiting on it."""
        if not wanted:
            comm.control.all_gather_object(None)
            comm.control.all_gather_object(False)
            return None
        _allow_peers()
        block = _block(comm.size)
        # Random bytes, not the pid: the process a peer's pid names here may not be the peer (see `_pid_namespace`),
        # and one running the same program, or a fork of the peer, can hold the same bytes at the same address.
        token = os.urandom(64)
        probe = ctypes.create_string_buffer(token)
        wake = _wake_socket()
        lib = _libc()
        name = wake.getsockname() if wake is not None else None
        usable = lib is not None and _stores_in_order()
        here = (_boot_id(), _pid_namespace())
        mine = (here, os.getpid(), ctypes.addressof(block), ctypes.addressof(probe), usable, name, token)
        infos = comm.control.all_gather_object(mine)
        ok = all(i is not None and i[0][0] is not None and i[0] == here and i[4] and i[5] is not None for i in infos)
        # One pid, one rank: a peer whose pid is ours here (the first process of its own container) passed the probe
        # by reading our own, wherever the two lay alike (1 launch in 4), and the link then read us for it.
        ok = ok and len({i[1] for i in infos}) == len(infos)
        for r, info in enumerate(infos if ok else ()):
            if r == comm.rank:
                continue
            _, pid, _, addr, _, peer_wake, peer_token = info
            got = ctypes.create_string_buffer(64)
            try:
                _copy(pid, addr, ctypes.addressof(got), 64)
                zero = ctypes.c_int64(0)  # and write: our slot of its block, with the value it already holds
                _copy(pid, infos[r][2] + 8 * (_DONE + comm.rank), ctypes.addressof(zero), 8, write=True)
                wake.sendto(b"?", socket.MSG_DONTWAIT, peer_wake)  # reachable: same host and network namespace
            except (RuntimeError, OSError) as err:
                logger.debug("cross-memory probe of rank %d failed: %s", r, err)
                ok = False
                break
            ok = got.raw == peer_token
            if not ok:
                break
        agreed = all(comm.control.all_gather_object(ok))  # the decision every rank takes, from what all saw
        if not agreed:
            logger.debug("group %s moves CPU data through gloo (ranks on different hosts or unreadable)", comm)
            if wake is not None:
                wake.close()
            return None
        return cls(
            rank=comm.rank,
            pids=[i[1] for i in infos],
            blocks=[i[2] for i in infos],
            block=block,
            wake=wake,
            wakes=[i[5] for i in infos],
        )

    # ------------------------------------------------------------------------------------------ operations
    def submit(self, what: str, kind: str, deadline_s: float, *args: Any) -> Work:
        """Queue one operation; every rank submits the same sequence. An all-reduce takes two sequence numbers (its
        reduce and its gather)."""
        run = getattr(self, f"_{kind}")
        with self._submitting:  # a number and a place in the queue together: the worker runs them in that order
            seq = self._seq + 1
            self._seq += 2 if kind == "all_reduce" else 1

            def body() -> None:
                run(seq, time.monotonic() + deadline_s, what, *args)

            work = Work(what, body)
            self._queue.put(work)
        return work

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the worker (at exit): it finishes the operation at hand, bounded by `timeout_s`."""
        self._stop = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def retire(self) -> None:
        """Let the worker end once the operations queued so far are done (the group is gone: `cma.link_of`)."""
        self._queue.put(None)

    def _serve(self) -> None:
        # Inference mode: the worker's own thread would otherwise record autograd, as a fresh thread does, where the
        # caller issued the collective under no_grad (or inference mode): an all-reduce of a leaf that requires grad
        # failed in its `out=` add, one of an inference tensor in its in-place copy, where gloo took both.
        with torch.inference_mode():
            while True:
                work = self._queue.get()
                if work is None:
                    break
                err = work.run(self._broken)
                self._broken = self._broken or (None if err is None else str(err))
                del work
        self._wake.close()  # only this thread waits on it

    # The steps of [Note: collectives by cross-memory attach].
    def _post(self, seq: int, t: torch.Tensor, code: int) -> None:
        self._block[_ADDR] = t.data_ptr()
        self._block[_NBYTES] = t.numel() * t.element_size()
        self._block[_CODE] = code
        self._block[_SEQ] = seq  # last: a peer that sees seq sees the rest
        self._poke()

    def _peek(self, peer: int, field: int) -> int:
        _copy(self.pids[peer], self.blocks[peer], ctypes.addressof(self._peek_buf), ctypes.sizeof(self._peek_buf))
        return int(self._peek_buf[field])

    def _await(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Block until `ready()`: woken by the peers' pokes ([Note: waking a waiting rank]), looking again at least
        every `_LOOK_S` (for the exit, the deadline, a peer that died without a poke)."""
        while not ready():
            if self._stop:
                raise RuntimeError(f"{what}: the process is exiting")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{what} timed out waiting for a peer (cross-memory transport)")
            self._wake.settimeout(min(left, _LOOK_S))
            with contextlib.suppress(TimeoutError, InterruptedError):
                self._wake.recv(16)
            self._wake.settimeout(0.0)  # non-blocking: a socket with a timeout waits for data even with MSG_DONTWAIT
            with contextlib.suppress(BlockingIOError, InterruptedError):
                while True:  # the pokes that came meanwhile say nothing more
                    self._wake.recv(16)

    def _poke(self) -> None:
        for p in self.peers:
            with contextlib.suppress(OSError):  # a full queue wakes it anyway; a gone peer shows in its reads
                self._wake.sendto(b"!", socket.MSG_DONTWAIT, self.wakes[p])

    def _addr_of(self, peer: int, seq: int, deadline: float, what: str) -> int:
        self._await(lambda: self._peek(peer, _SEQ) >= seq, deadline, what)
        return self._peek(peer, _ADDR)  # read after seq was seen: see `_post`

    def _matched(self, seq: int, deadline: float, what: str) -> dict[int, int]:
        """Each peer's input address for operation `seq`, once every peer posted the same operation as ours (kind, op,
        dtype, bytes); else raise before reading anything. gloo aborted the process on such a mismatch; read as posted,
        the peer's smaller input gave its memory beyond as data. Every rank finds a peer unlike itself, so all raise."""
        addrs, unlike = {}, []
        for p in self.peers:
            addrs[p] = self._addr_of(p, seq, deadline, what)
            nbytes, code = int(self._peek_buf[_NBYTES]), int(self._peek_buf[_CODE])
            if (nbytes, code) != (self._block[_NBYTES], self._block[_CODE]):
                unlike.append(f"group rank {p}: {_describe(code, nbytes)}")
        if unlike:
            mine = _describe(self._block[_CODE], self._block[_NBYTES])
            raise CollectiveMismatchError(
                f"{what}: the ranks issued different collectives (group rank {self.rank}: {mine}; "
                f"{'; '.join(unlike)}). Every rank must pass tensors of the same size and dtype to the same operation"
            )
        return addrs

    def _finish(self, seq: int, deadline: float, what: str) -> None:
        """Tell each peer we are done reading it (in its own block), then wait until each told us the same (in ours):
        our own memory, so a peer that finished and exited meanwhile still counts as done."""
        done = ctypes.c_int64(seq)
        for p in self.peers:
            _copy(self.pids[p], self.blocks[p] + 8 * (_DONE + self.rank), ctypes.addressof(done), 8, write=True)
        self._poke()
        self._await(lambda: all(self._block[_DONE + p] >= seq for p in self.peers), deadline, what)

    def _all_gather(self, seq: int, deadline: float, what: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        nbytes = inp.numel() * inp.element_size()
        self._post(seq, inp, _code("all_gather", "sum", inp.dtype))
        _fault_in(out)
        for p, src in self._matched(seq, deadline, what).items():
            _copy(self.pids[p], src, out.data_ptr() + p * nbytes, nbytes)
        out.view(-1)[self.rank * inp.numel() : (self.rank + 1) * inp.numel()].copy_(inp.view(-1))
        self._finish(seq, deadline, what)

    def _scratch(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Scratch buffer `i` shaped like `like`, kept between operations: a fresh one each time faulted its pages in
        anew (8k more page faults a step in the ZeRO-3 race)."""
        nbytes = like.numel() * like.element_size()
        buf = self._scratches.get(i)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratches[i] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(like.dtype).view(like.shape)

    def _reduced(
        self, seq: int, deadline: float, what: str, acc: torch.Tensor, own: torch.Tensor, offset: int, op: str
    ) -> None:
        """acc = own reduced with every peer's elements at byte `offset` of its input, in rank order: x0 op x1 first,
        then op x2, op x3, ... (the same operands in the same order on every rank). acc must not overlap own."""
        nbytes = acc.numel() * acc.element_size()
        addrs = self._matched(seq, deadline, what)

        def fetch(p: int, into: torch.Tensor) -> None:
            _fault_in(into)
            _copy(self.pids[p], addrs[p] + offset, into.data_ptr(), nbytes)

        combine = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
        if self.rank < 2:
            fetch(1 - self.rank, acc)  # the other of ranks 0 and 1, straight into acc
            if self.rank == 0:
                combine(own, acc, out=acc)
            else:
                combine(acc, own, out=acc)
        else:
            fetch(0, acc)
            tmp = self._scratch(0, acc)
            fetch(1, tmp)
            combine(acc, tmp, out=acc)
        for q in range(2, self.size):
            if q == self.rank:
                combine(acc, own, out=acc)
            else:
                tmp = self._scratch(0, acc)
                fetch(q, tmp)
                combine(acc, tmp, out=acc)
        if op == "avg":
            acc.div_(self.size)

    def _reduce_scatter(
        self, seq: int, deadline: float, what: str, out: torch.Tensor, inp: torch.Tensor, op: str
    ) -> None:
        n = out.numel()
        self._post(seq, inp, _code("reduce_scatter", op, inp.dtype))
        own = inp.view(-1)[self.rank * n : (self.rank + 1) * n]
        self._reduced(seq, deadline, what, out.view(-1), own, self.rank * n * inp.element_size(), op)
        self._finish(seq, deadline, what)

    def _all_reduce(self, seq: int, deadline: float, what: str, t: torch.Tensor, op: str) -> None:
        """A reduce-scatter then an all-gather in place, each rank owning the slice of its rank number: it reduces
        that slice (in rank order) from everyone's input and writes it into its own `t`, which no peer reads there;
        it posts again (seq + 1), which also says it has read everything it needed from the peers; then it copies
        every peer's reduced slice out of the peer's `t` into its own, where that peer no longer reads. Each element
        is reduced once, by its owner, so every rank gets the same bits; each moves a slice a peer each way, where
        reducing the whole tensor on every rank read all of it and took 0.78x gloo's time for 90 MiB, not 0.5x."""
        flat = t.view(-1)
        bounds = [flat.numel() * i // self.size for i in range(self.size + 1)]
        esize = flat.element_size()
        self._post(seq, flat, _code("all_reduce", op, flat.dtype))
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        acc = self._scratch(1, flat[lo:hi])
        self._reduced(seq, deadline, what, acc, flat[lo:hi], lo * esize, op)
        flat[lo:hi].copy_(acc)
        self._post(seq + 1, flat, self._block[_CODE])
        for p in self.peers:
            plo, phi = bounds[p], bounds[p + 1]
            src = self._addr_of(p, seq + 1, deadline, what)
            _copy(self.pids[p], src + plo * esize, flat.data_ptr() + plo * esize, (phi - plo) * esize)
        self._finish(seq + 1, deadline, what)
