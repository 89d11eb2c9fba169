"""Children that die with their parent: no process winnow starts outlives a kill -9 of its starter.

A process killed with SIGKILL runs no cleanup, so whatever it started is reparented and runs
on: spawned ranks finish their work (minutes of cores and GPU memory, writes into folders a
relaunched run now owns), a grading worker stuck in a sympy call grinds on, a launcher's
torchrun keeps training. Every spawner therefore has its child call :func:`exit_with_parent`
as soon as it runs (or passes :func:`exit_with_parent_preexec` to ``subprocess.Popen``):

* On Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the child when its parent
  goes, at once, even while the child is inside a C call that holds the GIL (a stuck
  sympy power) or blocks in one (a collective, a file write). The setting is cleared by ``fork``, kept across ``exec``.
  The death signal fires when the *thread* that forked the child exits, not the process:
  each winnow spawner forks from a thread that outlives its children (``run_ranks``' caller
  blocks until its ranks end; the grading pool's forkserver is started by the thread that
  constructs the pool, the trainer's main thread).
* A parent that died before the child set it (the child's interpreter start, seconds with
  torch, is a real window) is caught by checking, after setting it, that the parent is still
  the expected one; a ``multiprocessing`` child also checks its parent's sentinel (a pipe
  whose write end only the parent holds: for a forkserver child that is the process that
  asked for it, not the forkserver).
* Elsewhere, a daemon thread checks both every ``POLL_S``. It needs the GIL, so a child stuck
  in a long C call dies only when the call returns.

The signal is SIGKILL, never a catchable one: a child whose parent is gone has nobody to
report to, and running its ``finally`` blocks or signal handlers would let a rank start a
checkpoint or publish a staged folder after the relaunched run took over the output root.
What a SIGKILL interrupts is never visible: every durable write is staged and published by
one rename (``pipeline.io``, the checkpoint manager), so a write cut short leaves a ``.tmp``
the next run ignores or replaces.

megatron's checkpoint writer starts helper processes of its own (a results-queue manager,
forked file writers): :func:`megatron_checkpoint_writers_die_with_this_process` arms them too.

Cost: one system call per child at start (a thread per child where there is no ``prctl``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

__all__ = ["POLL_S", "exit_with_parent", "exit_with_parent_preexec",
           "megatron_checkpoint_writers_die_with_this_process"]

POLL_S = 0.5  # the fallback's check interval: the longest a child outlives its parent there
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None off Linux (or when libc cannot be loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _parent_gone(parent_pid: int, owner: BaseProcess | None) -> bool:
    """The expected parent is no longer ours (we were reparented), or the multiprocessing owner exited."""
    return os.getppid() != parent_pid or (owner is not None and not owner.is_alive())


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent_pid: int, owner: BaseProcess | None) -> None:
    while not _parent_gone(parent_pid, owner):
        time.sleep(POLL_S)
    _die()


def exit_with_parent(*, parent_pid: int | None) -> str:
    """Make this process die (SIGKILL) when its parent dies; call it first thing in a child.

    ``parent_pid`` is the pid the parent had when it started us (it passes ``os.getpid()``),
    which closes the window before this call; None uses ``os.getppid()`` now, for a child
    that cannot be told (a forkserver child, torchrun's ranks), and then only the
    ``multiprocessing`` sentinel, if any, covers that window. Returns the mechanism:
    ``"prctl"`` or ``"poll"``.
    """
    expected = os.getppid() if parent_pid is None else parent_pid
    owner = multiprocessing.parent_process()
    prctl = _load_prctl()
    mechanism = "prctl" if prctl is not None and prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 else "poll"
    # After arming, not before: a parent that dies from here on is caught by the kernel (or the thread).
    if _parent_gone(expected, owner):
        _die()
    if mechanism == "poll":
        threading.Thread(target=_watch, args=(expected, owner), name="winnow-exit-with-parent", daemon=True).start()
    return mechanism


def exit_with_parent_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that arms the death signal in the child before ``exec``.

    It survives the ``exec``, so it covers programs that are not winnow's (torchrun). The
    returned function runs between ``fork`` and ``exec``, where only async-signal-safe work
    is allowed: libc is loaded here, in the parent, and the child only calls into it. None
    where there is no ``prctl`` (pass it as is: ``preexec_fn=None`` is Popen's default);
    there, the launched program must watch its parent itself. Call it on the thread that
    waits for the child.
    """
    prctl = _load_prctl()
    if prctl is None:
        return None
    parent_pid = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return arm


def _arm_with_pid(parent_pid: int) -> None:
    """A ``SyncManager`` initializer (positional arguments only, picklable: module level)."""
    exit_with_parent(parent_pid=parent_pid)


_MEGATRON_UNWRAPPED_WARNED = False


def _warn_unwrapped() -> None:
    global _MEGATRON_UNWRAPPED_WARNED
    _MEGATRON_UNWRAPPED_WARNED = True
    logging.getLogger(__name__).warning(
        "megatron-core's checkpoint writer has no FileSystemWriterAsync.write_preloaded_data / "
        "_get_write_results_queue to wrap; its helper processes may outlive a kill -9 of this process")


def megatron_checkpoint_writers_die_with_this_process() -> None:
    """Tie megatron's checkpoint helper processes to this process; idempotent, call before the first save.

    megatron's ``torch_dist`` save (``FileSystemWriterAsync``, synchronous saves included) starts
    processes winnow does not: a ``multiprocessing`` manager (spawn) that serves its results queue,
    started at the first save and kept for the life of the process, and one forked writer per write
    bucket and save. After a kill -9 of the trainer the manager serves forever, and a writer goes on
    writing its part into the staged ``step_N.tmp`` folder, which a relaunch that saves step N again
    writes into too (at 7B on 8 ranks: up to a rank's 26.7 GB, half a minute at 1 GB/s). This wraps
    the two places megatron starts them, so each arms its death signal first; the manager is then
    tied to the thread that saves first (the trainer's main thread).
    """
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writer = getattr(filesystem_async, "FileSystemWriterAsync", None)
    if writer is None or not hasattr(writer, "write_preloaded_data") or \
            not hasattr(filesystem_async, "_get_write_results_queue"):
        # Another megatron-core than the 0.16 this wraps: its checkpoints still save (and are
        # published atomically); only its helpers may outlive a kill -9 of this process.
        if not _MEGATRON_UNWRAPPED_WARNED:
            _warn_unwrapped()
        return
    if getattr(writer.write_preloaded_data, "_dies_with_parent", False):
        return
    write = writer.write_preloaded_data

    def armed_write(*args, **kwargs) -> None:
        # A forked writer: its parent is the saving process (the multiprocessing sentinel covers the window).
        exit_with_parent(parent_pid=None)
        write(*args, **kwargs)

    def armed_results_queue():
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            manager.start(initializer=_arm_with_pid, initargs=(os.getpid(),))
            # The proxy keeps its manager (and so the server process) alive, as megatron's own does.
            filesystem_async._results_queue = manager.Queue()
        return filesystem_async._results_queue

    armed_write._dies_with_parent = True
    writer.write_preloaded_data = staticmethod(armed_write)
    filesystem_async._get_write_results_queue = armed_results_queue
