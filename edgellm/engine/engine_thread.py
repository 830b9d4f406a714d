"""Which thread runs the forward passes: the main thread, or one engine thread, so the process keeps one OpenMP team.

OpenMP (libgomp) keeps a team of workers for every thread that ran a parallel region, until that thread ends. With
two such threads alive there are more OpenMP threads than CPUs, and libgomp then lets an idle worker spin only about
100 times before it sleeps: every parallel region (hundreds a token) pays a wake-up. SmolLM2 decoded at 63-68 t/s
from a second thread of a ThreadPoolExecutor, against 150-190 from the first (2 cores).

So the main thread runs its forward passes itself, at no cost, while no other thread is generating. A forward pass
asked for by any other thread runs on one dedicated thread, `edgellm-engine`, and the caller waits for it (about
55 us a call); while that thread lives, the main thread's passes go there too, and the main thread frees its own
team first. The engine thread ends, and with it its team, after IDLE_S without work. A main thread that generated
before other threads did keeps its team until it calls again or calls edgellm.release_threads() (a warning says so
the first time another thread generates meanwhile).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import warnings

from edgellm.quant import threading_layer

IDLE_S = 2.0  # the engine thread's life without work: after it, its OpenMP team no longer counts against the CPUs


class ThreadTeamWarning(UserWarning):
    """Another thread generates while the main thread, idle, keeps the OpenMP team of its earlier generation."""


class _Job:
    __slots__ = ("fn", "args", "kwargs", "done", "result", "error")

    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Lock()
        self.done.acquire()
        self.result = self.error = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # handed to the waiting caller, which raises it
            self.error = e
        finally:
            self.done.release()

    def wait(self) -> None:
        """Until the job ran: an interrupt (Ctrl-C) while it runs is raised after it, never beside it, so the
        caller never sees a model that another thread is still changing."""
        interrupt = None
        while True:
            try:
                self.done.acquire()
                break
            except BaseException as e:
                interrupt = interrupt or e
        if interrupt is not None:
            raise interrupt


class EngineThreads:
    """The process's choice of thread for forward passes (module-level `engine_threads`; tests make their own)."""

    def __init__(self, release=threading_layer.release_thread_pool, idle_s: float = IDLE_S):
        self._release = release  # frees the calling thread's OpenMP team
        self.idle_s = idle_s
        self._reset()

    def _reset(self) -> None:
        """Also what a forked child runs (os.register_at_fork below): it has none of its parent's threads."""
        self._lock = threading.Lock()
        self.worker = None          # the engine thread, while it lives
        self.main_team = False      # the main thread ran forward passes itself since it last freed its team
        self.warned = False         # ThreadTeamWarning given (once a process)
        self._jobs = queue.SimpleQueue()

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the thread that runs forward passes; its result, or its exception raised here."""
        me = threading.current_thread()
        worker = self.worker
        if me is worker:  # a forward pass inside a job
            return fn(*args, **kwargs)
        main = me is threading.main_thread()
        if main and worker is None:
            self.main_team = True
            return fn(*args, **kwargs)
        if main and self.main_team:  # before the engine thread's team runs beside it
            self.main_team = False
            self._release()
        job = _Job(fn, args, kwargs)
        with self._lock:
            if self.worker is None:
                if self.main_team and not main and not self.warned:
                    self.warned = True
                    warnings.warn("the main thread generated earlier and keeps its OpenMP workers while it waits: "
                                  "until it calls again, generation from other threads runs at about half speed. "
                                  "Call edgellm.release_threads() on the main thread after its warm-up, or "
                                  "generate only from worker threads (edgellm's docs/kernels.md, Threads)",
                                  ThreadTeamWarning, stacklevel=4)
                self._start_worker()
            self._jobs.put(job)
        job.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _start_worker(self) -> None:
        jobs = self._jobs

        def serve():
            while True:
                try:
                    job = jobs.get(timeout=self.idle_s)
                except queue.Empty:
                    with self._lock:
                        if jobs.empty():  # callers queue under the lock: nothing can arrive after this
                            self.worker = None
                            return  # the thread's end frees its OpenMP team
                    continue
                job.run()

        self.worker = threading.Thread(target=serve, name="edgellm-engine", daemon=True)
        self.worker.start()


def release_threads() -> bool:
    """edgellm.release_threads: the calling thread's OpenMP team freed (True when the runtime did); for the main
    thread, also no longer counted as holding one."""
    et = engine_threads
    if threading.current_thread() is threading.main_thread():
        et.main_team = False
    return et._release()


engine_threads = EngineThreads()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=engine_threads._reset)


def on_engine_thread(method):
    """Decorator: the method runs where engine_threads.call puts it (forward passes)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return engine_threads.call(method, *args, **kwargs)
    return wrapper
