"""Removing this process's NVMe swap directories when SIGTERM ends it: a handler over the default one, and a watcher
thread that learns of the signal at once, even while the main thread is blocked in a C call
([Note: swap directories removed on SIGTERM])."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("hetero.memory.nvme")

# [Note: swap directories removed on SIGTERM]
# Schedulers and launchers end jobs with SIGTERM (Slurm's scancel and time limit, Kubernetes, torchrun stopping the
# other ranks once one failed), whose default action ends the process at once: no close(), no finalizer, and its swap
# directory stayed until the next store in the same nvme_dir swept it. So while this process holds a swap directory,
# SIGTERM goes through `_on_sigterm`, installed over the handler before it:
#   - before it the default (SIG_DFL): the directories this process made are removed, the default is put back and the
#     signal raised again, so the process still dies of SIGTERM (its exit status says so to the launcher);
#   - before it a handler of the program's own: that one runs, nothing is removed. It decides whether the process
#     ends (a handler that saves a checkpoint on preemption reads the NVMe tier after the signal); if it raises
#     (SystemExit, KeyboardInterrupt) the store's finalizer removes the directory as the interpreter exits;
#   - ignored (SIG_IGN), or set outside Python: left alone, nothing is installed.
# A Python handler runs only on the main thread, between bytecodes: a rank blocked in a C call that signals do not
# interrupt (a collective waiting on a peer, a long kernel, a read from a slow disk) ran it only when the call
# returned, after the scheduler's SIGKILL (30 s later under Slurm and Kubernetes), which left the swap file, tens of
# GB, behind. So the directories are removed by a watcher thread too: the C-level handler, which runs at once on
# whichever thread the kernel picked, writes the signal's number to the wakeup fd (`signal.set_wakeup_fd`), the
# write end of a socket pair whose read end the watcher reads; on SIGTERM, when the process is going to die of it
# (`_on_sigterm` installed over the default), the watcher removes this process's directories and ends the process of
# SIGTERM, as the default action would have at once: without hetero's handler a SIGTERM ended a blocked rank there
# and then, and with it the rank lived on until the scheduler's SIGKILL, a grace period later, or for good where
# nothing sends one. It puts the default action back below Python (libc's `signal`: Python's may be called only on
# the main thread) and raises the signal again, so the exit status still says SIGTERM. Whichever of the watcher and
# the main thread's handler comes first, the directories go and the process dies of the signal.
# A process has one wakeup fd: one set already (asyncio's event
# loop sets one) is kept and no watcher is used, as before. A child forked from the process shares the socket pair,
# so the child points its copy of the write end elsewhere (`_after_fork_in_child`): its SIGTERM woke the parent's
# watcher, which removed the parent's live directories.
# Only the main thread can install a handler; a store made on another thread uses the one a main-thread store
# installed, else its directory waits for the sweep ([Note: swap directories left by a killed process]), as before,
# and a warning says so. The handler and the wakeup fd are put back when the last directory goes (on the main
# thread), so that a process holding no swap file keeps the default.
# Each directory is removed only by the process that made it: a child forked from a rank (os.fork) inherits the
# handler, the registry and the store's finalizer, and when it ended (a SIGTERM, a normal exit, the store collected)
# it deleted the rank's live swap file under it.
_owned: tuple[tuple[str, int], ...] = ()  # (directory, pid that made it); replaced whole, read by the handler
_owned_lock = threading.Lock()  # writers only: the handler reads `_owned` without it (it may interrupt a holder)
_before: list[Any] = []  # the SIGTERM handler `_on_sigterm` replaced, while it is installed
_warned = [False]  # the warning for a store off the main thread is given once
_wake: list[socket.socket] = []  # [read end, write end] of the watcher's socket pair, in this process
_waking = [False]  # whether the write end is the process's wakeup fd now (set by `_watch`)


def own(directory: str) -> None:
    """This process made `directory`: removed on SIGTERM ([Note: swap directories removed on SIGTERM])."""
    global _owned
    with _owned_lock:
        _owned = (*_owned, (directory, os.getpid()))
    previous = signal.getsignal(signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    if previous is _on_sigterm and main:
        _watch()  # installed by the process this one was forked from: a watcher of its own
    if _before or previous is signal.SIG_IGN or previous is None or previous is _on_sigterm:
        return
    if not main:
        if not _warned[0]:
            _warned[0] = True
            log.warning(
                "NVMe swap directory %s was made off the main thread, where no SIGTERM handler can be installed: a "
                "SIGTERM leaves it until the next store in the same nvme_dir removes it. Create the first engine "
                "with an NVMe tier on the main thread to have it removed at once",
                directory,
            )
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _before.append(previous)
    _watch()


def disown(directory: str) -> None:
    """`directory` is gone or going: the last one puts the handler before hetero's back (on the main thread)."""
    global _owned
    with _owned_lock:
        _owned = tuple(o for o in _owned if o[0] != directory)
        last = not any(pid == os.getpid() for _, pid in _owned)
    if not (last and threading.current_thread() is threading.main_thread()):
        return
    _unwatch()
    if _before and signal.getsignal(signal.SIGTERM) is _on_sigterm:  # else someone installed theirs over it
        signal.signal(signal.SIGTERM, _before[0])
        _before.clear()


def _remove_mine() -> None:
    pid = os.getpid()
    for directory, owner in _owned:
        if owner == pid:
            shutil.rmtree(directory, ignore_errors=True)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    previous = _before[0] if _before else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)  # the program's own: it decides, and the store stays usable
        return
    _remove_mine()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)  # dies of it, as without the handler


def _dying() -> bool:
    """Whether a SIGTERM now ends the process through `_on_sigterm` (not a program's handler, which decides)."""
    before = _before[:1]  # a copy: the main thread may clear it meanwhile
    return signal.getsignal(signal.SIGTERM) is _on_sigterm and bool(before) and not callable(before[0])


def _watcher(reader: socket.socket) -> None:
    """Reads the signal numbers the C-level handler writes; removes this process's directories on SIGTERM."""
    while True:
        try:
            got = reader.recv(256)
        except OSError:
            return
        if not got:
            return
        if signal.SIGTERM in got and _dying():
            _remove_mine()
            _die_of_sigterm()


def _die_of_sigterm() -> None:
    """End the process of SIGTERM from the watcher thread ([Note: swap directories removed on SIGTERM]): the default
    action put back in C, then the signal raised again. Where libc cannot be reached, the main thread's handler ends
    it when its C call returns."""
    try:
        c_signal = ctypes.CDLL(None).signal  # the process's own symbols, libc's among them
    except (OSError, AttributeError):
        return
    c_signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    c_signal.restype = ctypes.c_void_p
    c_signal(int(signal.SIGTERM), None)  # SIG_DFL is the null handler
    os.kill(os.getpid(), signal.SIGTERM)


def _watch() -> None:
    """Make the watcher's socket pair the wakeup fd, unless the program has one; on the main thread."""
    if _waking[0]:
        return
    if not _wake:
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the C-level handler must never block
        _wake[:] = [reader, writer]
        threading.Thread(target=_watcher, args=(reader,), name="hetero-sigterm-watcher", daemon=True).start()
    try:
        theirs = signal.set_wakeup_fd(_wake[1].fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError) as e:
        log.debug("no SIGTERM watcher (%s): a rank blocked in a C call removes its swap files only after it", e)
        return
    if theirs != -1:  # the program's own (asyncio's): keep it; the handler on the main thread removes them
        signal.set_wakeup_fd(theirs, warn_on_full_buffer=False)
        return
    _waking[0] = True


def _unwatch() -> None:
    """Stop being the wakeup fd (the watcher stays, idle, for the next store); one set over ours is left."""
    if not _waking[0]:
        return
    _waking[0] = False
    current = signal.set_wakeup_fd(-1)
    if current != _wake[1].fileno():
        signal.set_wakeup_fd(current, warn_on_full_buffer=False)


def _after_fork_in_child() -> None:
    """The socket pair is the parent's too: the child's SIGTERM must not reach the parent's watcher."""
    if not _wake:
        return
    if _waking[0]:
        try:
            _unwatch()
        except ValueError:  # not the main thread of the child: the fd stays the wakeup fd, pointed at nothing
            devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            os.dup2(devnull, _wake[1].fileno(), inheritable=False)
            os.close(devnull)
            _wake[1].detach()  # its number stays the wakeup fd: never closed
            _wake[0].close()
            _wake.clear()
            return
    for end in _wake:
        end.close()
    _wake.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
