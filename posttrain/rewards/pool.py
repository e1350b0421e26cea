"""A pool of killable worker processes for verifiers: each call has a time limit (docs/rewards.md).

Why not `concurrent.futures.ProcessPoolExecutor`: a task that hangs (sympy on `9^{9^{9^9}}`, a regex
with catastrophic backtracking) cannot be cancelled there; here each task has a deadline, a worker
that overruns is SIGKILLed and replaced, and the batch still returns in order. Workers are started
with the `spawn` context: the trainer holds torch threads, and forking it is unsafe.

    pool = WorkerPool(workers=2)
    outcomes = pool.map(fn, [args1, args2], timeout=5.0)   # fn: a top-level (picklable) function
    outcomes[0].value / .error / .timed_out
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait


@dataclass
class Outcome:
    value: object = None
    error: str | None = None  # "ExcType: message" + traceback tail when the function raised
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def _worker_main(conn) -> None:
    """Worker loop: receive (fn, args), send ("ok", value) or ("err", text)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, args = msg  # unpickling imported fn's module: only now does the clock start
        conn.send(("start", None))
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as e:  # report, never die silently
            tb = traceback.format_exc(limit=4)
            try:
                conn.send(("err", f"{type(e).__name__}: {e}\n{tb}"))
            except Exception:
                return


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.task: int | None = None
        self.deadline = 0.0
        self.started = 0.0

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(5)
        except Exception:
            pass
        self.conn.close()


class WorkerPool:
    """`workers` processes; `map` runs one call per item with a per-item deadline."""

    def __init__(self, workers: int = 2, context: str = "spawn", startup_grace: float = 120.0):
        self.n = max(1, int(workers))
        self.ctx = mp.get_context(context)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # one map at a time; callers from several threads queue up
        self.killed = 0  # workers killed for overrunning (a metric)
        # a fresh worker first imports the task's module (sympy, math-verify: seconds on a busy
        # machine); the task's own deadline starts when the worker reports "start"
        self.startup_grace = startup_grace
        atexit.register(self.close)

    def _ensure(self) -> None:
        self._workers = [w for w in self._workers if w.proc.is_alive()]
        while len(self._workers) < self.n:
            self._workers.append(_Worker(self.ctx))

    def map(self, fn, items: list[tuple], timeout: float) -> list[Outcome]:
        with self._lock:
            return self._map(fn, items, timeout)

    def _map(self, fn, items: list[tuple], timeout: float) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(items)
        pending = list(range(len(items)))[::-1]
        self._ensure()
        busy: dict = {}  # conn -> worker
        while pending or busy:
            for w in self._workers:
                if w.task is None and pending:
                    i = pending.pop()
                    w.task, w.started = i, time.monotonic()
                    w.deadline = w.started + timeout + self.startup_grace
                    try:
                        w.conn.send((fn, items[i]))
                    except Exception as e:  # dead pipe or unpicklable function/argument
                        results[i] = Outcome(error=f"{type(e).__name__}: {e}")
                        w.task = None
                        continue
                    busy[w.conn] = w
            if not busy:
                continue
            now = time.monotonic()
            wait_for = max(0.0, min(w.deadline for w in busy.values()) - now)
            for conn in wait(list(busy), timeout=wait_for):
                w = busy[conn]
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    kind, payload = "died", None
                if kind == "start":
                    w.started = time.monotonic()
                    w.deadline = w.started + timeout
                    continue
                busy.pop(conn)
                i, w.task = w.task, None
                took = time.monotonic() - w.started
                try:
                    if kind == "died":
                        raise EOFError
                    results[i] = Outcome(value=payload, seconds=took) if kind == "ok" else Outcome(error=payload, seconds=took)
                except (EOFError, OSError):  # the worker died (e.g. killed by the OOM killer)
                    results[i] = Outcome(error="worker process died", seconds=took)
                    self._replace(w)
            now = time.monotonic()
            for conn, w in list(busy.items()):
                if now >= w.deadline:  # overran: kill it and start a fresh one
                    busy.pop(conn)
                    results[w.task] = Outcome(timed_out=True, seconds=now - w.started)
                    w.task = None
                    self.killed += 1
                    self._replace(w)
        return results  # type: ignore[return-value]

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self._workers.append(_Worker(self.ctx))

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except Exception:
                pass
        for w in self._workers:
            w.proc.join(1)
            if w.proc.is_alive():
                w.kill()
        self._workers = []


_DEFAULT: dict[int, WorkerPool] = {}


def default_pool(workers: int | None = None) -> WorkerPool:
    """The process-wide pool (one per pid, so a forked child never reuses the parent's pipes)."""
    pool = _DEFAULT.get(os.getpid())
    if pool is None or (workers is not None and pool.n != workers):
        if pool is not None:
            pool.close()
        n = workers if workers is not None else int(os.environ.get("POSTTRAIN_REWARD_WORKERS", min(4, os.cpu_count() or 1)))
        pool = _DEFAULT[os.getpid()] = WorkerPool(n)
    return pool
