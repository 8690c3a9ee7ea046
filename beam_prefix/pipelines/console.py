"""How a CLI process ends: one line on the console and one exit status, whatever happened,
with the detail in a log file the line names.

Every CLI (`pipelines.classify`, `extract`, `fit`, `tune`) runs its work through `run_cli`:

- exit statuses: 0 done, 1 the run failed (or lost rows), 2 refused at launch (bad flags,
  input, task file, model or output location), 130 Ctrl-C (SIGINT), 143 SIGTERM. A signal
  is one path for every CLI: the handler records which signal came and raises in the main
  thread, so the run unwinds (staging discarded, locks released, nothing published) and
  ends with the signal's status even where a runner wrapped the interruption in an error
  of its own;
- the console gets one line per log record (its first line; no traceback) and the CLI's
  own progress lines; what was cut (tracebacks, multi-line errors, library warnings, a
  thread's uncaught exception) is kept, bounded, in memory, and written to a new file in
  the temporary directory (``beam-prefix-<cli>-*.log``) when the run fails, which the final
  error line names. ``BEAM_PREFIX_LOG_FILE=PATH`` writes the whole log there as it goes;
- what libraries log or warn while a CLI process imports them (Google's clients on an older
  grpcio) is held and shown the same way, one line each. Only a CLI process holds them (run
  with ``-m``, as a console script, or by a wrapper that sets ``BEAM_PREFIX_CLI=1``): a
  program of your own that imports the pipelines keeps its own logging and warnings.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
from typing import Callable

from beam_prefix.errors import ModelLoadError

__all__ = ["run_cli", "explain", "exit_process", "Terminated", "StopSignal", "stop_on_signals", "LaunchError",
           "EXIT_FAILED", "EXIT_REFUSED", "EXIT_SIGINT", "EXIT_SIGTERM"]

EXIT_FAILED, EXIT_REFUSED, EXIT_SIGINT, EXIT_SIGTERM = 1, 2, 130, 143
_DETAIL_RECORDS = 20_000  # log records kept in memory for the failure log (the newest)


class LaunchError(Exception):
    """Marks an error raised before the run started (exit 2), whatever its type."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so that a run
    stopped by `kill` or a scheduler unwinds the same way: staging discarded, locks released."""


@dataclasses.dataclass
class StopSignal:
    """The signal that stopped the run, if one did (a runner running a bundle in the main
    thread may report the interruption raised there as an error of its own)."""

    signum: int | None = None

    @property
    def received(self) -> bool:
        return self.signum is not None


@contextlib.contextmanager
def stop_on_signals(stop: StopSignal):
    """While the block runs, SIGINT and SIGTERM record themselves in `stop` and raise
    (KeyboardInterrupt, `Terminated`) in the main thread; the previous handlers are
    restored after. Off the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        _Console.stopping = True
        first = stop.signum is None
        stop.signum = stop.signum or signum
        if first:  # (a second signal while unwinding: let the unwinding finish)
            _forward(signum)
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _forward(signum: int) -> None:
    """Pass the signal on to this process's descendants: a local runner's worker processes
    (`--direct_running_mode=multi_processing`, subprocess workers; each under a ``/bin/sh -c``)
    wait on the runner, which, unwinding, waits for them to exit; a `kill` of the launcher
    alone reaches only it (a terminal's Ctrl-C reaches the whole group), so the run would
    never end, or its workers would live on orphaned."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # no /proc: nothing to find them by
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                children.setdefault(int(f.read().rsplit(b")", 1)[1].split()[1]), []).append(pid)
        except (OSError, IndexError, ValueError):  # (gone meanwhile)
            continue
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for pid in found:  # (all of them, the shells' children too: a shell passes on no signal)
        try:
            os.kill(pid, signum)
        except OSError:  # gone, or not ours to signal
            continue


# runner errors that have a known cause, and the one line that says it
_KNOWN_CAUSES = (
    ("PublishError", "publishing the outputs failed"),
    ("Channel closed prematurely", "a worker process died (killed, or out of memory)"),
    ("WorkerLost", "a worker process died (killed, out of memory, or its command could not start)"),
    ("MemoryError", "a worker ran out of memory"),
    ("ContextLengthError", "the task's prompt does not fit the model's context"),
    ("VerificationError", "the start-up self-check found cached scoring different from full re-encoding"),
    ("ModelLoadError", "the model could not be loaded"),
    ("PermissionError", "an output location is not writable"),
    ("No space left on device", "a disk is full"),
)


def explain(error: BaseException, outputs: dict[str, str] | None = None) -> str:
    """One line for a run that failed: the cause where it is known, the error's first line,
    and that nothing was published."""
    text = f"{type(error).__name__}: {error}"
    cause = next((why for pattern, why in _KNOWN_CAUSES if pattern in text), "the run failed")
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    final = getattr(error, "final", None)
    if final:  # a publish that could not be undone: say exactly what is final
        where = f"; these files are final: {', '.join(final)}"
    else:
        where = f"; nothing was written to {', '.join(outputs.values())}" if outputs else ""
    return f"error: {cause} ({type(error).__name__}: {_cut(first, 400)}){where}"


def _cut(text: str, limit: int) -> str:
    """`text` at most `limit` characters, cut at a word boundary (never mid-word)."""
    if len(text) <= limit:
        return text
    head = text[:limit].rsplit(" ", 1)[0].rstrip(",;:")
    return f"{head} ..."


class _OneLine(logging.Formatter):
    """A record's first line, without its traceback (kept for the failure log)."""

    def format(self, record: logging.LogRecord) -> str:
        lines = record.getMessage().splitlines() or [""]
        return f"{self.formatTime(record, '%H:%M:%S')} {record.name}: {lines[0]}"


QUIET_THREADS = ("remote-probe",)  # threads whose clients' retries are detail: the probe's verdict is the line


class _Console(logging.Filter):
    """This package's records from INFO, everyone else's from WARNING; but once a signal
    stopped the run, or from a `QUIET_THREADS` thread, only this package's (the libraries'
    reports of the interruption, or of a probe's retries, go to the failure log)."""

    stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == "beam_prefix" or record.name.startswith("beam_prefix.")
        if not own and (_Console.stopping or record.threadName in QUIET_THREADS):
            return False
        return record.levelno >= (logging.INFO if own else logging.WARNING)


class _Detail(logging.Handler):
    """The newest records in full (message, traceback), for the failure log."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: collections.deque[str] = collections.deque(maxlen=_DETAIL_RECORDS)
        self.cut = False  # a record whose console line left something out
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s]: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.records.append(self.format(record))
            if record.exc_info or "\n" in record.getMessage():
                self.cut = True

    def keep(self, what: str, error: BaseException, *, cut: bool) -> None:
        """`error` in full, for the failure log only (the console gets the final line);
        `cut`: its traceback is detail the final line leaves out (not so for a refusal at
        launch, whose line says all)."""
        import traceback

        self.records.append(f"{what}:\n" + "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        self.cut = self.cut or cut

    def write(self, cli: str) -> str | None:
        """The kept records into a new file of the temporary directory; its path (None: nothing
        was cut, or no file could be written)."""
        if not self.cut:
            return None
        try:
            fd, path = tempfile.mkstemp(prefix=f"beam-prefix-{cli}-", suffix=".log")
            with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
                f.write("\n".join(self.records) + "\n")
            return path
        except OSError:
            return None


_MARK = "_beam_prefix_cli"  # on the handlers `setup_logging` added (replaced by the next call)


def _implicit(handler: logging.Handler) -> bool:
    """The handler `logging.basicConfig` adds when a library logs through the root logger
    before any set-up (Beam 2.70 does at import): a plain stderr stream with the default
    format, not a host's choice."""
    return (type(handler) is logging.StreamHandler and getattr(handler, "stream", None) is sys.stderr
            and (handler.formatter is None or handler.formatter._fmt == logging.BASIC_FORMAT))


class _Held(logging.Handler):
    """Log records and warnings from before `setup_logging`: a CLI importing its libraries
    (an older grpcio makes Google's clients warn at import, Beam logs a missing crcmod). They
    wait here, then go through the console and detail handlers as one line each."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _started_as_a_cli() -> bool:
    """Whether this process is one of the CLIs (``python -m beam_prefix.pipelines.fit``, the
    checkout's ``python -m pipelines.fit``, a ``beam-prefix-*`` console script, or a wrapper
    that says so with ``BEAM_PREFIX_CLI=1``), not a program of its own that imports them (its
    logging and warnings stay its own)."""
    if os.environ.get("BEAM_PREFIX_CLI") == "1":
        return True
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1].startswith(("beam_prefix.pipelines.", "pipelines."))
    return os.path.basename(sys.argv[0] if sys.argv else "").startswith("beam-prefix-")


_HELD = _Held()
setattr(_HELD, _MARK, True)
if _started_as_a_cli() and not logging.getLogger().handlers:  # (a host that set up logging keeps its own)
    logging.getLogger().addHandler(_HELD)
    logging.captureWarnings(True)
    # local worker processes (DirectRunner multi_processing) import the same libraries and
    # would print the same import-time FutureWarnings raw; this process logs its own once
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")


def setup_logging() -> _Detail:
    """The console and the detail handlers on the root logger (those of an earlier call in
    this process replaced); library warnings and threads' uncaught exceptions routed through
    logging. Returns the detail handler."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _MARK, False) or _implicit(h)]:
        root.removeHandler(handler)
    detail = _Detail()
    handlers: list[logging.Handler] = [detail]
    if not root.handlers:  # (as logging.basicConfig: a host that set up logging keeps its own)
        console = logging.StreamHandler(sys.stderr)
        console.addFilter(_Console())
        console.setFormatter(_OneLine())
        handlers.append(console)
    if os.environ.get("BEAM_PREFIX_LOG_FILE"):
        full = logging.FileHandler(os.environ["BEAM_PREFIX_LOG_FILE"], encoding="utf-8")
        full.setFormatter(detail.formatter)
        handlers.append(full)
    for handler in handlers:
        setattr(handler, _MARK, True)
        root.addHandler(handler)
    logging.getLogger("beam_prefix").setLevel(logging.INFO)  # progress lines, not Beam's own chatter
    logging.captureWarnings(True)
    held, _HELD.records = _HELD.records, []
    for record in held:
        root.handle(record)

    def hook(args):  # a thread's uncaught exception: a log record, not a traceback on the console
        if args.exc_type is SystemExit:
            return
        if _Console.stopping:  # (a runner's threads ending because the run was stopped: detail only)
            detail.keep(f"thread {getattr(args.thread, 'name', '?')} ended", args.exc_value, cut=False)
            return
        logging.getLogger("beam_prefix.pipelines").error(
            "thread %s ended with %s: %s", getattr(args.thread, "name", "?"), args.exc_type.__name__, args.exc_value,
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    threading.excepthook = hook
    return detail


def run_cli(call: Callable[[], object], *, cli: str, started: Callable[[], bool] = lambda: False,
            nothing: str = "nothing was written", refused: tuple[type, ...] = (ValueError, OSError, ModelLoadError),
            outputs: Callable[[], dict[str, str] | None] = lambda: None,
            report: Callable[[object], int] | None = None) -> int:
    """Run `call()` as the CLI `cli` and return its exit status (see the module docstring).

    Args:
        call: the CLI's work; returns what `report` reads.
        cli: its name, for the failure log's file name.
        started: whether the run got past its launch checks: an error before that of a type
            in `refused` is exit 2, any other error exit 1.
        nothing: what the line of a stopped run says was left (``nothing was published``).
        outputs: the outputs the run would have written, for the final line.
        report: prints the result and returns the status (default: 0).
    """
    detail = setup_logging()
    _Console.stopping = False
    stop = StopSignal()
    try:
        with stop_on_signals(stop):
            result = call()
    except BaseException as e:  # noqa: BLE001 - every way out is one line and a status
        if stop.received or isinstance(e, KeyboardInterrupt):  # (a runner may wrap it in its own error)
            terminated = stop.signum == signal.SIGTERM or isinstance(e, Terminated)
            detail.keep(f"stopped by {'SIGTERM' if terminated else 'SIGINT'}", e, cut=False)
            _say(f"error: {'terminated (SIGTERM)' if terminated else 'interrupted'}; {nothing}", None)
            return EXIT_SIGTERM if terminated else EXIT_SIGINT
        if not isinstance(e, Exception):
            raise
        at_launch = not started() and isinstance(e, refused + (LaunchError,))
        detail.keep(f"the {'launch' if at_launch else 'run'}'s error", e, cut=not at_launch)
        line = f"error: {str(e).strip() or type(e).__name__}" if at_launch else explain(e, outputs())
        _say(line, detail.write(cli))
        return EXIT_REFUSED if at_launch else EXIT_FAILED
    return 0 if report is None else report(result)


def _say(line: str, log: str | None) -> None:
    """The final line on stderr (one line), naming the failure log if one was written."""
    line = " ".join(line.split("\n"))
    print(line + (f" (details: {log})" if log else ""), file=sys.stderr, flush=True)


def exit_process(status: int) -> None:
    """End a pipeline's process with `status` (its ``__main__``).

    A run that ended in an error (any status but 0) ends the process at once, without the
    interpreter's finalization: its outputs were discarded and its locks released before
    `main` returned, and finalization would only tear down library state while library
    threads may still run (a runner thread still waiting for a lost worker,
    `pipelines.worker_watch`, would keep the interpreter from exiting at all; a native
    thread pool destroyed under a running thread aborts the process with "terminate called
    without an active exception", exit 134, instead of the status the run chose)."""
    if status == 0:
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)
