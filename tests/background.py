"""Subprocess checks that run beside the main test process.

Some tests spend minutes in a child process that is mostly single-threaded: a cold Numba compile (`edgellm warmup`
into an empty cache, kernels built for another CPU) or the CUDA simulator. Run one after another inside the test
process, they leave a core idle for that long. A test marked `@pytest.mark.background(jobs=...)` names its child
processes instead: `jobs(item)` returns `Job`s, which conftest queues as soon as collection ends. One runner thread
runs them in order, one at a time, while the main process goes on with other tests; the test then takes each job's
result with `result(key)` and asserts on it as before.

Queued children run under the idle scheduling class (SCHED_IDLE on Linux; nice 19 elsewhere), so they take only CPU
time the main process leaves unused: a child competing at equal priority would hold one of the main process's
OpenMP threads off its core, and every parallel region would wait for it. So nothing timed runs in the background
(a prompt's tokens per second would measure the main process's load).

A job nobody queued (its test run on its own, or the queue stopped) runs in the foreground when its result is
asked for, so every test means the same thing either way.
"""
import dataclasses
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


@dataclasses.dataclass
class Job:
    key: str
    args: list
    env: dict | None = None
    cwd: str | None = None
    # A hang guard only: a queued job gets CPU time only when the main process leaves some.
    timeout: float = 3600
    text: bool = True  # stdout and stderr as text


class _Done:
    def __init__(self):
        self.started = False  # claimed under _lock by the runner thread or by a test that will not wait
        self.event = threading.Event()
        self.outcome = None  # a CompletedProcess, or the exception running it raised (TimeoutExpired, OSError)


def _claim(done):
    with _lock:
        if done.started:
            return False
        done.started = True
        return True


_jobs: dict[str, Job] = {}
_done: dict[str, _Done] = {}
_pending: "queue.Queue[Job | None]" = queue.Queue()
_current: list = []  # the running Popen, so the session's end can stop it
_lock = threading.Lock()
_runner: threading.Thread | None = None
_tmp_root: Path | None = None


# Runs the job's command in the idle scheduling class (inherited by its threads and children).
_IDLE_LAUNCHER = """
import os, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
os.execv(sys.argv[1], sys.argv[1:])
"""


def _run(job, idle):
    """The job's CompletedProcess, or the exception it raised; a timed-out child is killed with its output kept."""
    args = [sys.executable, "-c", _IDLE_LAUNCHER, *job.args] if idle else job.args
    try:
        with subprocess.Popen(args, env=job.env, cwd=job.cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=job.text) as proc:
            _current.append(proc)
            try:
                out, err = proc.communicate(timeout=job.timeout)
            except subprocess.TimeoutExpired as e:
                proc.kill()
                out, err = proc.communicate()
                return subprocess.TimeoutExpired(job.args, job.timeout, output=out, stderr=err or e.stderr)
            finally:
                _current.remove(proc)
        return subprocess.CompletedProcess(job.args, proc.returncode, out, err)
    except OSError as e:
        return e


def _loop():
    while (job := _pending.get()) is not None:
        done = _done[job.key]
        if _claim(done):  # not already taken by a test that asked for it before the queue reached it
            done.outcome = _run(job, idle=True)
            done.event.set()


def submit(jobs):
    """Queue jobs to run in the background, in order; a key already known is not queued twice."""
    global _runner
    with _lock:
        for job in jobs:
            if job.key in _jobs:
                continue
            _jobs[job.key] = job
            _done[job.key] = _Done()
            _pending.put(job)
        if _runner is None:
            _runner = threading.Thread(target=_loop, name="background-tests", daemon=True)
            _runner.start()


def result(job):
    """The finished CompletedProcess of `job` (a Job, or the key of a queued one). A job running in the background
    is waited for; one not started yet, or never queued, runs now. Re-raises TimeoutExpired or OSError as the
    foreground run would."""
    key = job if isinstance(job, str) else job.key
    with _lock:
        done = _done.get(key)
        if done is None:
            done = _done[key] = _Done()
            _jobs[key] = job
    if _claim(done):
        done.outcome = _run(_jobs[key], idle=False)
        done.event.set()
    done.event.wait()
    if isinstance(done.outcome, BaseException):
        raise done.outcome
    return done.outcome


def temp_dir(name):
    """A directory for background jobs that lives until the session ends (jobs start before any tmp_path exists)."""
    global _tmp_root
    with _lock:
        if _tmp_root is None:
            _tmp_root = Path(tempfile.mkdtemp(prefix="edgellm-background-"))
    path = _tmp_root / name
    path.mkdir(exist_ok=True)
    return path


def shutdown():
    """Stop the queue: the running child is killed, queued ones never start, the temporary files go."""
    _pending.put(None)
    for proc in list(_current):
        proc.kill()
    if _runner is not None:
        _runner.join(timeout=30)
    if _tmp_root is not None:
        shutil.rmtree(_tmp_root, ignore_errors=True)


def child_env(**overrides):
    """os.environ with overrides; a value of None removes the variable."""
    env = dict(os.environ)
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env
