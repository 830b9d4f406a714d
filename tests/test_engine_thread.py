"""Forward passes run on one live thread at a time (edgellm/engine/engine_thread.py): the first thread to ask runs
them itself; once a second live thread asks, all of them run on the `edgellm-engine` thread and the first frees its
OpenMP team, so the process keeps one team however many threads generate."""
import os
import sys
import threading
import time
import warnings

import numba
import numpy as np
import pytest

import edgellm
from edgellm.engine import engine_thread
from edgellm.engine.engine_thread import EngineThreads, ThreadTeamWarning
from edgellm.quant import threading_layer
from hardening_tiny import tiny_spec, write_loadable_tiny_model

JOIN_TIMEOUT_S = 60


def _in_thread(fn):
    """fn() on a new thread that stays alive until the returned release() is called; returns (result, release)."""
    box, done, leave = [], threading.Event(), threading.Event()

    def body():
        try:
            box.append(fn())
        except BaseException as e:  # handed back to the test
            box.append(e)
        done.set()
        leave.wait(JOIN_TIMEOUT_S)

    t = threading.Thread(target=body)
    t.start()
    assert done.wait(JOIN_TIMEOUT_S)

    def release():
        leave.set()
        t.join(JOIN_TIMEOUT_S)

    return box[0], release


@pytest.fixture
def threads():
    released = []
    et = EngineThreads(release=lambda: released.append(threading.current_thread()), idle_s=0.2)
    yield et, released
    assert _settles(lambda: et.worker is None)  # no engine thread outlives the test


def test_the_main_thread_runs_its_calls_itself_while_no_other_thread_generates(threads):
    et, released = threads
    assert et.call(threading.current_thread) is threading.main_thread()
    assert et.worker is None and et.main_team and released == []


def test_another_threads_calls_run_on_the_engine_thread_and_then_the_main_threads_too(threads):
    et, released = threads
    et.call(lambda: None)
    ran_on, release = _in_thread(lambda: et.call(threading.current_thread))
    try:
        assert ran_on is et.worker and ran_on.name == "edgellm-engine"
        # while it lives the main thread's calls go there too; the main thread frees its OpenMP team once
        assert et.call(threading.current_thread) is et.worker
        assert et.call(threading.current_thread) is et.worker
        assert released == [threading.main_thread()] and not et.main_team
    finally:
        release()


def test_a_thread_that_generates_while_the_main_thread_keeps_its_team_is_warned_once(threads):
    et, _ = threads
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, release = _in_thread(lambda: et.call(lambda: None))  # the main thread has no team yet: no warning
        release()
        assert _settles(lambda: et.worker is None)
        et.call(lambda: None)  # now it has one
        for _ in range(2):
            _, release = _in_thread(lambda: et.call(lambda: None))
            release()
            assert _settles(lambda: et.worker is None)
    assert [w.category for w in caught] == [ThreadTeamWarning]


def test_release_threads_on_the_main_thread_frees_its_team_so_other_threads_are_not_warned(threads, monkeypatch):
    et, released = threads
    monkeypatch.setattr(engine_thread, "engine_threads", et)
    et.call(lambda: None)
    assert et.main_team
    edgellm.release_threads()
    assert released == [threading.main_thread()] and not et.main_team
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, release = _in_thread(lambda: et.call(lambda: None))
        release()
    assert [w for w in caught if w.category is ThreadTeamWarning] == []


def test_the_engine_thread_ends_when_idle_and_the_main_thread_runs_its_calls_again(threads):
    et, released = threads
    ran_on, release = _in_thread(lambda: et.call(threading.current_thread))
    release()
    assert ran_on.name == "edgellm-engine" and released == []  # the main thread had no team to free
    assert _settles(lambda: et.worker is None) and not ran_on.is_alive()
    assert et.call(threading.current_thread) is threading.main_thread()


def test_results_and_exceptions_come_back_to_the_caller(threads):
    et, _ = threads

    def from_another_thread():
        out = [et.call(lambda a, b=0: a + b, 2, b=3)]
        try:
            et.call(lambda: {}["missing"])
        except KeyError as e:
            out.append(e)
        return out

    (value, error), release = _in_thread(from_another_thread)
    release()
    assert value == 5 and isinstance(error, KeyError) and error.args == ("missing",)


def test_a_call_inside_a_job_runs_where_the_job_runs(threads):
    et, _ = threads
    inner, release = _in_thread(lambda: et.call(lambda: et.call(threading.current_thread)))
    release()
    assert inner.name == "edgellm-engine"  # no deadlock: the engine thread does not queue work for itself


def test_release_thread_pool_frees_the_calling_threads_openmp_team():
    @numba.njit(parallel=True)
    def total(a):
        s = 0.0
        for i in numba.prange(a.shape[0]):
            s += a[i]
        return s

    def run_and_release():
        total(np.ones(64))
        with_team = _foreign_threads()
        freed = threading_layer.release_thread_pool()
        return with_team, freed

    if numba.config.NUMBA_NUM_THREADS < 2 or not sys.platform.startswith("linux"):
        pytest.skip("needs two Numba threads and Linux's /proc to see an OpenMP team (CI has both)")
    before = _foreign_threads()
    (with_team, freed), release = _in_thread(run_and_release)
    try:
        if threading_layer.chosen_layer() != "omp":
            pytest.skip("Numba's OpenMP layer is not loaded here (CI has it)")
        assert freed and len(with_team - before) == numba.config.NUMBA_NUM_THREADS - 1
        assert _settles(lambda: not (_foreign_threads() - before))
    finally:
        release()


def _foreign_threads() -> set:
    """The process's OS threads that are not Python threads (OpenMP's workers among them)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


def _settles(check, timeout_s: float = 5.0) -> bool:
    """Whether check() holds within timeout_s (a freed team's threads end on their own schedule)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _tiny_model_on_private_engine_threads(tmp_path, monkeypatch, seed, tokens):
    """A private EngineThreads in place of the process's, and logits() of a tiny model's forward over tokens from a
    fresh cache; logits() has run once on the main thread (its warm-up: its team). Returns (engine threads,
    logits, that first result). Skips where OpenMP teams cannot be counted."""
    et = EngineThreads()
    monkeypatch.setattr(engine_thread, "engine_threads", et)
    if numba.config.NUMBA_NUM_THREADS < 2 or not sys.platform.startswith("linux"):
        pytest.skip("needs two Numba threads and Linux's /proc to count OpenMP teams (CI has both)")
    m = edgellm.load(str(write_loadable_tiny_model(tmp_path / "tiny.gguf", tiny_spec(seed=seed))), n_ctx=64,
                     n_threads=2)
    tokens = np.array(tokens, np.int32)

    def logits():
        m.model.reset()
        return m.model.forward(tokens).copy()

    first = logits()
    if threading_layer.chosen_layer() != "omp":
        pytest.skip("Numba's OpenMP layer is not loaded here (CI has it)")
    return et, logits, first


def test_generating_from_another_thread_keeps_one_openmp_team_and_the_same_logits(tmp_path, monkeypatch):
    et, logits, mine = _tiny_model_on_private_engine_threads(tmp_path, monkeypatch, 3, [1, 2, 3, 4, 5])
    one_team = _foreign_threads()
    with pytest.warns(ThreadTeamWarning):  # the main thread keeps its team until its next call, below
        theirs, release = _in_thread(logits)  # stays alive: its team, had it made one, would stay too
    try:
        again = logits()
        assert np.array_equal(theirs, mine) and np.array_equal(again, mine)
        # the engine thread's team replaced this thread's: as many foreign threads as with one team
        assert _settles(lambda: len(_foreign_threads()) == len(one_team)), (one_team, _foreign_threads())
    finally:
        release()
        assert _settles(lambda: et.worker is None, 2 * et.idle_s + 5)


def test_after_release_threads_another_threads_generation_keeps_one_openmp_team_while_the_main_thread_waits(
        tmp_path, monkeypatch):
    et, logits, _ = _tiny_model_on_private_engine_threads(tmp_path, monkeypatch, 4, [1, 2, 3])
    one_team = _foreign_threads()
    assert edgellm.release_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThreadTeamWarning)
        theirs, release = _in_thread(logits)
    try:  # the engine thread's team, and not the main thread's beside it, with no call from the main thread
        assert isinstance(theirs, np.ndarray), theirs  # not the warning, raised as an error in that thread
        assert _settles(lambda: len(_foreign_threads()) == len(one_team)), (one_team, _foreign_threads())
    finally:
        release()
        assert _settles(lambda: et.worker is None, 2 * et.idle_s + 5)
