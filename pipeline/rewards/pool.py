"""``GradingPool``: grade batches in bounded worker processes with a per-item deadline.

How a batch flows (``grade_batch``):

1. The parent runs ``grader.prepare`` on every item: tail truncation, last-box
   extraction and the normalization/exact-rational fast path. That decides most RL
   answers in microseconds with no sympy, so only the undecided items (symbolic
   answers, responses without a box) are sent to workers.
2. Undecided items go to idle workers in chunks of up to ``chunk_size`` over a pipe.
   A worker reports ``start`` and ``result`` for every item, so the parent always
   knows which item each worker is on and since when: the deadline is per item.
3. A worker whose current item passes ``deadline_s`` is SIGKILLed (a stuck sympy call
   is often a single C call that no signal interrupts) and replaced; that item scores
   0 with reason ``timeout`` and the rest of its chunk is re-dispatched.
4. Work stealing keeps a stuck item from holding up the items queued behind it: when
   a worker is idle, nothing is queued, and another worker has spent more than
   ``deadline_s / 10`` on its current item, the parent revokes that worker's
   not-yet-started items and hands them to the idle one. So the wall time of a batch
   is about ``ceil(num_stuck / num_workers) * deadline_s`` plus the normal work.

Memory: each worker caps its address space with ``RLIMIT_AS = memory_limit_mb``, so a
memory bomb (``2^{2^{30}}`` maps ~0.7 GB) gets MemoryError instead of swapping the
node. math-verify swallows that MemoryError, so an item that raises the worker's peak
RSS by half its headroom under the cap (``_worker.MEMORY_FLAG_FRACTION``) is reported
as ``memory`` and the worker retires. A worker killed by a SIGKILL the pool did not
send (the kernel OOM killer) also yields ``memory``; any other death yields
``worker_error``. Either way the batch returns.

Processes come from the ``forkserver`` start method with the worker module
preloaded: no fork of a threaded trainer (CUDA, NCCL), and a replacement costs a fork
of a warm server rather than a sympy import. The parent installs no signal handlers,
so the pool is safe to use from the trainer's main thread; ``grade_batch`` calls are
serialized by a lock. As with any ``multiprocessing`` user, a script that creates a
pool needs an ``if __name__ == "__main__":`` guard.

A kill -9 of the pool's owner leaves no worker behind, not even one stuck in a C call: the
forkserver dies with its owner and each worker with the forkserver (Linux death signals,
``pipeline.parallel.lifetime``; a ``spawn`` worker dies with the owner directly). The
forkserver is started by the thread that constructs the first pool and dies when that
thread exits, so construct pools on a thread that outlives them (the main thread); under
``spawn`` a replacement worker is tied to the thread that called ``grade_batch``. If this
process had started its forkserver before the first pool (without this preload), idle
workers still exit at their pipe's end of file, but a busy one finishes its item first.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

from pipeline.rewards.grader import Grade, GradeOptions, PendingGrade, Reason, apply_answer_rules, failure, prepare

__all__ = ["GradingPool"]

# The forkserver's preload: arms its death signal, then imports the worker module.
_FORKSERVER_PRELOAD = "pipeline.rewards._forkserver"
# After this many failed worker starts in a row within one batch (crash, or no
# "ready" within startup_timeout_s) per worker slot, the items still queued fail with
# worker_error instead of being retried forever.
_MAX_START_FAILURES_PER_WORKER = 3
_STOP_JOIN_TIMEOUT_S = 5.0
# The exit status of a forkserver child travels through the server; allow it to arrive.
_EXIT_STATUS_TIMEOUT_S = 1.0
# A worker's current item is a stealing candidate after this fraction of the deadline.
_STEAL_AFTER_FRACTION = 0.1


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    # Item ids sent to this worker and not yet answered, in the order it grades them.
    in_flight: list[int] = field(default_factory=list)
    current: int | None = None  # the item it last reported starting
    last_event_at: float = 0.0  # last dispatch, start or result
    retiring: bool = False

    @property
    def busy(self) -> bool:
        return bool(self.in_flight) or self.current is not None

    def not_started(self) -> list[int]:
        if self.current in self.in_flight:
            return self.in_flight[self.in_flight.index(self.current) + 1 :]
        return list(self.in_flight)


@dataclass(eq=False)
class _Batch:
    pending: dict[int, PendingGrade]
    results: list[Grade | None]
    queue: deque[int]  # item ids waiting for a worker, in dispatch order

    def settle(self, item_id: int, result: Grade) -> bool:
        """Record ``result`` unless the item already has one (a stolen duplicate)."""
        if self.results[item_id] is not None:
            return False
        self.results[item_id] = result
        if item_id in self.queue:
            self.queue.remove(item_id)
        return True

    def requeue_first(self, item_ids: list[int]) -> None:
        """Put unsettled ``item_ids`` back at the head of the queue, in order."""
        self.queue.extendleft(reversed([i for i in item_ids if self.results[i] is None]))


def _worker_entry(*args: Any) -> None:
    """Process target. Imports the worker module in the child only, so the parent (the
    trainer) never loads sympy; under forkserver the module is already preloaded."""
    from pipeline.rewards import _worker

    _worker.worker_main(*args)


def _default_num_workers() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _kill_workers(workers: list[_Worker]) -> None:
    """Finalizer for a pool dropped without ``close()``; must not reference the pool."""
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()


class GradingPool:
    """Worker processes that grade ``(response, gold)`` pairs with a per-item deadline.

    ``num_workers`` defaults to the CPUs this process may run on. ``deadline_s`` is the
    wall-clock budget of one math-verify grading; ``memory_limit_mb`` the per-worker
    address-space cap (``None``: uncapped); ``chunk_size`` how many items travel per
    message. ``format_reward``, ``max_response_chars`` and ``max_answer_chars`` are
    ``grader.GradeOptions``. ``start_method`` is ``"forkserver"`` (default) or
    ``"spawn"``; ``"fork"`` is refused because forking a threaded trainer is unsafe.

    The constructor waits until every worker is ready, so a bad ``memory_limit_mb``
    raises ``ValueError`` here rather than failing every item later.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        deadline_s: float = 5.0,
        memory_limit_mb: int | None = 1024,
        chunk_size: int = 8,
        format_reward: float = 0.0,
        max_response_chars: int = 8192,
        max_answer_chars: int = 1024,
        numeric_answers: str = "literal",
        start_method: str = "forkserver",
        startup_timeout_s: float = 60.0,
    ) -> None:
        num_workers = _default_num_workers() if num_workers is None else num_workers
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not (math.isfinite(deadline_s) and deadline_s > 0):
            raise ValueError(f"deadline_s must be a positive number, got {deadline_s!r}")
        if memory_limit_mb is not None and memory_limit_mb < 1:
            raise ValueError(f"memory_limit_mb must be >= 1 or None, got {memory_limit_mb}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be positive, got {startup_timeout_s!r}")
        self.num_workers = num_workers
        self.deadline_s = float(deadline_s)
        self.memory_limit_mb = memory_limit_mb
        self.chunk_size = chunk_size
        self.options = GradeOptions(
            format_reward=format_reward,
            max_response_chars=max_response_chars,
            max_answer_chars=max_answer_chars,
            numeric_answers=numeric_answers,
        )
        self._startup_timeout_s = float(startup_timeout_s)
        self._steal_after_s = _STEAL_AFTER_FRACTION * self.deadline_s
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Takes effect only if this process has not started its forkserver yet.
            self._context.set_forkserver_preload([_FORKSERVER_PRELOAD])
        self._lock = threading.Lock()
        self._closed = False
        self._start_failures = 0
        self._metrics: dict[str, float] = {
            "num_items": 0,
            "num_fast_path": 0,
            "num_math_verify": 0,
            "num_timeouts": 0,
            "num_memory": 0,
            "num_worker_errors": 0,
            "num_worker_starts": 0,
            "num_stolen": 0,
            "worker_peak_rss_mb": 0.0,
            "last_batch_s": 0.0,
        }
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _kill_workers, self._workers)
        try:
            self._fill_workers(strict=True)
            self._wait_until_ready()
        except BaseException:
            self._finalizer()
            self._closed = True
            raise

    # ----------------------------------------------------------------------------------
    # public API

    def grade_batch(self, pairs: Iterable[tuple[str, str] | tuple[str, str, str | None]]) -> list[Grade]:
        """Grades of ``(response, gold)`` or ``(response, gold, problem)`` items, in input order.

        Never raises for content. The fast path runs here in the parent; only undecided
        items go to workers. With the problem text, an answer copied from the question is
        not correct (``answer_rules``); pass it wherever it is known.
        """
        items = [(item[0], item[1], item[2] if len(item) > 2 else None) for item in pairs]
        with self._lock:
            if self._closed:
                raise RuntimeError("GradingPool is closed")
            start = time.monotonic()
            results: list[Grade | None] = []
            pending: dict[int, PendingGrade] = {}
            for item_id, (response, gold, problem) in enumerate(items):
                prepared = prepare(response, gold, self.options, problem)
                if isinstance(prepared, Grade):
                    results.append(prepared)
                else:
                    results.append(None)
                    pending[item_id] = prepared
            self._metrics["num_items"] += len(results)
            self._metrics["num_fast_path"] += len(results) - len(pending)
            self._metrics["num_math_verify"] += len(pending)
            if pending:
                try:
                    self._run(_Batch(pending=pending, results=results, queue=deque(pending)))
                except BaseException:
                    # KeyboardInterrupt and friends: busy workers hold stale items.
                    for worker in [w for w in self._workers if w.busy]:
                        self._kill(worker)
                    raise
            self._metrics["last_batch_s"] = time.monotonic() - start
            assert all(grade is not None for grade in results)
            return [apply_answer_rules(grade, gold=gold, problem=problem, options=self.options)
                    for grade, (_, gold, problem) in zip(results, items)]

    @property
    def metrics(self) -> dict[str, float]:
        """Cumulative counters: items, fast-path hits, timeouts, restarts, steals, peak RSS."""
        return dict(self._metrics)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring; they change on restarts)."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def close(self) -> None:
        """Stop and join every worker. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                try:
                    worker.conn.send(("stop",))
                except OSError:
                    pass
            for worker in self._workers:
                worker.process.join(_STOP_JOIN_TIMEOUT_S)
            self._finalizer()

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------------
    # worker lifecycle

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_entry,
            args=(child_conn, self.options, self.memory_limit_mb),
            name="winnow-grader",
            daemon=True,
        )
        process.start()
        # Keep only the parent's end, so a dead worker reads as EOF.
        child_conn.close()
        self._metrics["num_worker_starts"] += 1
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    def _fill_workers(self, *, strict: bool = False) -> None:
        """Start workers up to ``num_workers``. During a batch a failed start (out of
        file descriptors, say) counts towards giving up instead of raising."""
        while len(self._workers) < self.num_workers:
            try:
                self._workers.append(self._start_worker())
            except Exception:
                if strict:
                    raise
                self._start_failures += 1
                return

    def _kill(self, worker: _Worker) -> int | None:
        """SIGKILL (if still alive), reap and forget ``worker``; returns its exit code
        as it was before this call (``None``: it was alive). Its items are the caller's."""
        exitcode = worker.process.exitcode
        if exitcode is None:
            worker.process.kill()
        worker.process.join()
        worker.conn.close()
        worker.process.close()
        self._workers.remove(worker)
        return exitcode

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while not all(worker.ready for worker in self._workers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"grading workers did not start within {self._startup_timeout_s:.0f} s"
                )
            for conn in wait([w.conn for w in self._workers if not w.ready], remaining):
                worker = next(w for w in self._workers if w.conn is conn)
                try:
                    message = worker.conn.recv()
                except EOFError:
                    raise RuntimeError("a grading worker exited during startup") from None
                if message[0] == "init_error":
                    raise ValueError(message[1])
                assert message[0] == "ready", message[0]
                worker.ready = True

    # ----------------------------------------------------------------------------------
    # the batch loop

    def _run(self, batch: _Batch) -> None:
        # Each batch retries failed starts afresh, so a transient failure is not fatal.
        self._start_failures = 0
        while batch.queue or any(w.busy for w in self._workers):
            self._fill_workers()
            gave_up = self._start_failures >= _MAX_START_FAILURES_PER_WORKER * self.num_workers
            if gave_up and not any(w.ready for w in self._workers):
                for item_id in list(batch.queue):
                    self._fail(batch, item_id, Reason.WORKER_ERROR)
            self._steal(batch)
            self._dispatch(batch)
            if not self._workers:
                continue  # nothing to wait for; the next pass retries the start
            by_handle: dict[Any, _Worker] = {}
            for worker in self._workers:
                by_handle[worker.conn] = worker
                by_handle[worker.process.sentinel] = worker
            for handle in wait(list(by_handle), self._seconds_to_next_event(batch)):
                worker = by_handle[handle]
                if worker in self._workers:
                    self._receive(worker, batch)
            self._enforce_deadlines(batch)
        # Replace killed workers now, so they warm up before the next batch.
        self._fill_workers()

    def _idle_workers(self) -> list[_Worker]:
        return [w for w in self._workers if w.ready and not w.busy and not w.retiring]

    def _dispatch(self, batch: _Batch) -> None:
        for worker in self._idle_workers():
            if not batch.queue:
                return
            size = max(1, min(self.chunk_size, math.ceil(len(batch.queue) / self.num_workers)))
            chunk = [batch.queue.popleft() for _ in range(min(size, len(batch.queue)))]
            payload = [
                (item_id, item.answer, item.response_tail, item.gold, item.has_box)
                for item_id, item in ((i, batch.pending[i]) for i in chunk)
            ]
            try:
                worker.conn.send(("grade", payload))
            except OSError:
                # Died while idle: nothing of this chunk ran, so nothing is blamed.
                batch.requeue_first(chunk)
                self._kill(worker)
                continue
            worker.in_flight = chunk
            worker.last_event_at = time.monotonic()

    def _steal(self, batch: _Batch) -> None:
        """Move not-started items from workers busy on a long item to idle workers."""
        if batch.queue or not self._idle_workers():
            return
        now = time.monotonic()
        for victim in self._workers:
            if victim.current is None or now - victim.last_event_at < self._steal_after_s:
                continue
            stolen = victim.not_started()
            if not stolen:
                continue
            try:
                victim.conn.send(("revoke", stolen))
            except OSError:
                continue  # it died; _receive hands its items back
            # The victim may already have started stolen[0] before reading the revoke;
            # then both workers grade it and the first result wins (``_Batch.settle``).
            victim.in_flight = [item for item in victim.in_flight if item not in stolen]
            batch.queue.extend(stolen)
            self._metrics["num_stolen"] += len(stolen)

    def _seconds_to_next_event(self, batch: _Batch) -> float:
        events = [w.last_event_at + self.deadline_s for w in self._workers if w.busy]
        events += [w.started_at + self._startup_timeout_s for w in self._workers if not w.ready]
        if not batch.queue and self._idle_workers():
            events += [
                w.last_event_at + self._steal_after_s
                for w in self._workers
                if w.current is not None and w.not_started()
            ]
        if not events:
            return self._startup_timeout_s
        return max(0.0, min(events) - time.monotonic())

    def _receive(self, worker: _Worker, batch: _Batch) -> None:
        """Handle everything ``worker`` sent, then its exit if it has exited."""
        try:
            # poll() is also true at EOF, where recv() raises EOFError.
            while worker.conn.poll():
                self._handle_message(worker, worker.conn.recv(), batch)
        except (EOFError, OSError):
            self._on_exit(worker, batch)
            return
        if not worker.process.is_alive():
            self._on_exit(worker, batch)

    def _handle_message(self, worker: _Worker, message: tuple[Any, ...], batch: _Batch) -> None:
        kind = message[0]
        if kind == "start":
            worker.current = message[1]
            worker.last_event_at = time.monotonic()
        elif kind == "result":
            _, item_id, score, reason, extracted, peak_rss_mb = message
            if item_id in worker.in_flight:
                worker.in_flight.remove(item_id)
            worker.current = None
            worker.last_event_at = time.monotonic()
            if batch.settle(item_id, Grade(score, Reason(reason), extracted)):
                self._count(Reason(reason))
            peak_mb = max(self._metrics["worker_peak_rss_mb"], peak_rss_mb)
            self._metrics["worker_peak_rss_mb"] = peak_mb
        elif kind == "ready":
            worker.ready = True
            self._start_failures = 0
        elif kind == "retire":
            worker.retiring = True
        else:
            # A replacement could not honour the memory cap; it exits next.
            assert kind == "init_error", kind

    def _on_exit(self, worker: _Worker, batch: _Batch) -> None:
        if not worker.ready:
            self._start_failures += 1
        # The item being graded when the worker died is the likely cause; blaming one
        # item per death also guarantees progress. A SIGKILL the pool did not send is
        # most likely the kernel OOM killer.
        culprit = worker.current
        if culprit is None and worker.in_flight:
            culprit = worker.in_flight[0]
        unfinished = [item for item in worker.in_flight if item != culprit]
        retiring = worker.retiring
        worker.process.join(_EXIT_STATUS_TIMEOUT_S)
        exitcode = self._kill(worker)
        if retiring:
            unfinished = [item for item in [culprit, *unfinished] if item is not None]
        elif culprit is not None:
            reason = Reason.MEMORY if exitcode == -signal.SIGKILL else Reason.WORKER_ERROR
            self._fail(batch, culprit, reason)
        batch.requeue_first(unfinished)

    def _enforce_deadlines(self, batch: _Batch) -> None:
        for worker in list(self._workers):
            if not worker.ready:
                if time.monotonic() - worker.started_at > self._startup_timeout_s:
                    self._kill(worker)
                    self._start_failures += 1
                continue
            if not worker.busy or time.monotonic() - worker.last_event_at <= self.deadline_s:
                continue
            # A result may have landed since wait() returned.
            self._receive(worker, batch)
            if worker not in self._workers or not worker.busy:
                continue
            if time.monotonic() - worker.last_event_at <= self.deadline_s:
                continue
            stuck = worker.current if worker.current is not None else worker.in_flight[0]
            rest = [item for item in worker.in_flight if item != stuck]
            self._kill(worker)
            self._fail(batch, stuck, Reason.TIMEOUT)
            batch.requeue_first(rest)

    def _fail(self, batch: _Batch, item_id: int, reason: Reason) -> None:
        if batch.settle(item_id, failure(reason, batch.pending[item_id].answer)):
            self._count(reason)

    def _count(self, reason: Reason) -> None:
        key = {
            Reason.TIMEOUT: "num_timeouts",
            Reason.MEMORY: "num_memory",
            Reason.WORKER_ERROR: "num_worker_errors",
        }.get(reason)
        if key is not None:
            self._metrics[key] += 1
