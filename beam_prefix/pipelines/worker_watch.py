"""Ends a local run whose worker process died where Beam's runner would wait for it forever.

On Beam's local runners (`--direct_running_mode=multi_processing`, a `PortableRunner` with
subprocess workers) each worker is a subprocess started by a runner thread, which raises
``RuntimeError('Worker subprocess exited with return code N')`` when it exits non-zero. A
worker that dies after connecting to the runner fails the run (``Channel closed
prematurely``); one that dies before it connects (killed during its imports, or a command
that cannot start: a wrong ``--environment_config`` exits 127) leaves the runner waiting
for it without a timeout, so the run never ends. `WorkerWatch` sees the runner thread's
error (through `threading.excepthook`) and, when the run has not ended `grace_s` later,
interrupts it: the run raises `WorkerLost`, publishes nothing (its outputs are staged) and
the pipeline exits 1 with one line saying so. During the run the main thread's SIGUSR2
handler is the watch's (the previous one is restored after); off the main thread, or
where there is no SIGUSR2, the watch does nothing.
"""

from __future__ import annotations

import re
import signal
import threading
import time

__all__ = ["WorkerLost", "WorkerWatch"]

# the message of Beam's runner thread for a worker subprocess that exited non-zero
# (apache_beam.runners.portability.local_job_service.SubprocessSdkWorker.run)
_WORKER_EXIT = re.compile(r"Worker subprocess exited with return code (-?\d+)")


class WorkerLost(RuntimeError):
    """A worker process exited and the runner did not end the run."""


class _Stop(BaseException):
    """Raised in the main thread by the watch's signal (a BaseException: no `except Exception`
    of the runner's catches it)."""


# a real signal, not `_thread.interrupt_main`: the main thread may be blocked in a lock's
# acquire (a queue read of the job's state stream), which only a signal interrupts
_SIGNAL = getattr(signal, "SIGUSR2", None)


class WorkerWatch:
    """A context around a pipeline's run (on the main thread): when a worker process exits
    non-zero and the run has not ended `grace_s` seconds later, the run is interrupted and
    the context raises `WorkerLost`. Beam's own error wins when it comes within the grace
    (a connected worker's death fails the run in seconds)."""

    def __init__(self, *, grace_s: float = 15.0):
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._ended = threading.Event()  # the run ended (set under the lock: no signal after it)
        self._died = threading.Event()  # a worker exited non-zero, or the run ended
        self._fired: str | None = None  # what died, once the run was interrupted for it
        self._code: str | None = None
        self._previous = None
        self._previous_handler = None

    def __enter__(self) -> "WorkerWatch":
        self._previous = threading.excepthook
        threading.excepthook = self._hook
        # signal handlers are the main thread's (POSIX): elsewhere the watch stays passive
        if _SIGNAL is not None and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(_SIGNAL, _raise_stop)
            threading.Thread(target=self._watch, name="beam-prefix-worker-watch", daemon=True).start()
        return self

    def _hook(self, args) -> None:
        match = _WORKER_EXIT.search(str(args.exc_value)) if isinstance(args.exc_value, RuntimeError) else None
        if match and self._code is None:
            self._code = match.group(1)
            self._died.set()
        self._previous(args)  # the traceback still goes to the log

    def _watch(self) -> None:
        self._died.wait()  # also set when the run ends, so this thread never outlives it
        if self._ended.wait(self.grace_s):
            return
        with self._lock:
            if not self._ended.is_set():
                self._fired = f"a worker process exited with return code {self._code}"
                signal.pthread_kill(threading.main_thread().ident, _SIGNAL)

    def __exit__(self, exc_type, exc, tb):
        try:
            with self._lock:
                self._ended.set()
            self._died.set()
            threading.excepthook = self._previous
            if self._fired and exc_type is not _Stop:
                time.sleep(0.5)  # the signal still pending lands here, not in what follows
        except _Stop:
            pass
        finally:
            if self._previous_handler is not None:
                signal.signal(_SIGNAL, self._previous_handler)
        if self._fired:
            raise WorkerLost(f"{self._fired} and the runner kept waiting for it; the run was stopped "
                             f"{self.grace_s:g} s later (a worker that dies before it connects, or "
                             f"a worker command that cannot start, e.g. a wrong --environment_config)") from exc
        return False  # a run that ended by itself stands: Beam fails it where a worker's work was lost


def _raise_stop(signum, frame):
    raise _Stop()
