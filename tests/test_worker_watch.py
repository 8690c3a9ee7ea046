"""A local run whose worker process died where Beam's runner waits for it forever is ended
(`pipelines.worker_watch`): the watch itself here, the pipelines' use in test_reliability."""

from __future__ import annotations

import queue
import signal
import threading
import time

import pytest

from beam_prefix.pipelines.worker_watch import WorkerLost, WorkerWatch

pytestmark = [pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="the watch signals the main thread (POSIX)"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")]


def _runner_thread_fails(message: str, delay_s: float = 0.1) -> threading.Thread:
    """A thread that raises as Beam's worker-starting thread does when its subprocess exits."""
    def body():
        time.sleep(delay_s)
        raise RuntimeError(message)

    thread = threading.Thread(target=body, name="run_worker")
    thread.start()
    return thread


@pytest.fixture
def main_thread():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the watch interrupts the main thread only")


def test_a_dead_worker_ends_a_run_blocked_without_a_timeout(main_thread):
    """The run blocks as the portable runner's wait does (a queue read, which only a signal
    interrupts): it is stopped after the grace with WorkerLost naming the code."""
    before = signal.getsignal(signal.SIGUSR2), threading.excepthook
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="return code 127 and the runner kept waiting"):
        with WorkerWatch(grace_s=0.3):
            _runner_thread_fails("Worker subprocess exited with return code 127")
            queue.Queue().get(timeout=20)  # never answered (the timeout only keeps a broken watch from hanging)
    assert time.monotonic() - start < 10
    assert (signal.getsignal(signal.SIGUSR2), threading.excepthook) == before


def test_the_runners_own_error_within_the_grace_wins_and_nothing_fires_later(main_thread):
    with pytest.raises(ValueError, match="Channel closed prematurely"):
        with WorkerWatch(grace_s=0.5):
            _runner_thread_fails("Worker subprocess exited with return code 137").join()
            raise ValueError("Channel closed prematurely.")
    time.sleep(1.0)  # past the grace: no signal arrives once the run has ended


def test_a_run_that_ends_by_itself_stands_and_the_watch_leaves_nothing_behind(main_thread):
    before = signal.getsignal(signal.SIGUSR2), threading.excepthook
    with WorkerWatch(grace_s=0.2):
        time.sleep(0.1)
    time.sleep(0.3)
    assert (signal.getsignal(signal.SIGUSR2), threading.excepthook) == before
    assert not [t for t in threading.enumerate() if t.name == "beam-prefix-worker-watch"]


def test_other_thread_errors_do_not_stop_the_run(main_thread):
    with WorkerWatch(grace_s=0.2):
        _runner_thread_fails("some other error in a thread").join()
        time.sleep(0.6)  # past the grace: not stopped
