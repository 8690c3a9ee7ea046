"""Locks beside a run's outputs, so that two runs into the same output are never both told
that their rows were written.

Every pipeline takes, at launch and before anything is staged or loaded, one lock per
output it writes: a file ``.beam-prefix-lock-<name>`` beside the output. A second run into
an output that is locked is refused (`OutputLockedError`, exit 2) with the holder's pid,
host and start time. The lock is released when the run ends, whatever its outcome, and the
lock file is removed then.

- Local outputs: an exclusive ``flock`` on the lock file. The kernel releases it when the
  process dies, however it dies (``kill -9`` included), so a killed run never leaves it
  held: the next run takes it (and removes the file when it ends).
- Outputs on a Beam file system (``gs://`` ...): object stores have no locks, so the lock
  is a lease: the file holds its owner and an expiry `LEASE_S` ahead, renewed by the holder
  every third of that. A killed run's lease expires; a live run's is refused. Taking a
  lease is a write then a read-back (the last writer of two racing runs owns it, the other
  is refused): narrow, not atomic, as object stores allow without preconditions.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Iterable, Iterator

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from beam_prefix.pipelines.paths import is_local, join, split
from beam_prefix.pipelines.publish import OutputLocationError

__all__ = ["OutputLockedError", "LOCK_PREFIX", "LEASE_S", "lock_path", "locked", "FileLock", "Lease"]

_LOGGER = logging.getLogger(__name__)
LOCK_PREFIX = ".beam-prefix-lock-"
LEASE_S = 600.0  # a remote lease's life without renewal: how long a killed run's lease holds


class OutputLockedError(OutputLocationError):
    """Another run is writing the same output."""


def lock_path(output: str) -> str:
    """The lock file of the output at `output` (a file, a sharded prefix or a directory)."""
    directory, name = split(output.rstrip("/") if not is_local(output) else os.path.abspath(output))
    return join(directory, LOCK_PREFIX + name)


def _owner() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "token": uuid.uuid4().hex}


def _held_by(info: dict | None) -> str:
    if not info:
        return "another run"
    return f"run {info.get('pid')} on {info.get('host')}, started {info.get('since')}"


class FileLock:
    """An exclusive ``flock`` on a local lock file (see the module docstring).

    Args:
        path: the lock file. flag, output: named in the refusal.
    """

    def __init__(self, path: str, *, flag: str, output: str):
        self.path, self.flag, self.output = path, flag, output
        self._fd: int | None = None
        self._made: list[str] = []  # folders the lock created, deepest first: removed if left empty

    def acquire(self) -> None:
        import fcntl

        folder = os.path.abspath(os.path.dirname(self.path) or ".")
        while not os.path.exists(folder):
            self._made.append(folder)
            folder = os.path.dirname(folder)
        while True:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # a run that made the folder removed it, empty, as it ended
                continue
            except OSError as e:  # (as `Staging.preflight` says it, which would come next)
                raise OutputLocationError(f"{self.flag}={self.output}: cannot write to "
                                          f"{os.path.dirname(self.path)!r} ({type(e).__name__}: {e.strerror or e})"
                                          ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise OutputLockedError(
                    f"{self.flag}={self.output} is being written by {_held_by(_read_local(self.path))} "
                    f"(lock {self.path}); wait for it to end, or write elsewhere") from None
            # the holder before us may have removed the file between our open and our lock:
            # then we hold a lock on a file no one else can see, so take the one at the path
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_owner()).encode("utf-8"))
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)  # while still held: a run waiting to open it opens a new file
        os.close(self._fd)
        self._fd = None
        for folder in self._made:  # a run refused or failed leaves no folder it made (rmdir: only when empty)
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _read_local(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.loads(f.read(4096) or "null")
    except (OSError, ValueError):
        return None


class Lease:
    """A lease file on a Beam file system (see the module docstring).

    Args:
        path: the lease file. flag, output: named in the refusal. lease_s: its life.
    """

    def __init__(self, path: str, *, flag: str, output: str, lease_s: float = LEASE_S):
        self.path, self.flag, self.output, self.lease_s = path, flag, output, lease_s
        self._me = _owner()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _read(self) -> dict | None:
        try:
            with FileSystems.open(self.path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
                return json.loads(f.read(4096).decode("utf-8") or "null")
        except Exception:  # noqa: BLE001 - absent or unreadable: not held
            return None

    def _write(self) -> None:
        data = dict(self._me, expires=time.time() + self.lease_s)
        with FileSystems.create(self.path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            f.write(json.dumps(data).encode("utf-8"))

    def _refuse(self, holder: dict | None) -> None:
        raise OutputLockedError(
            f"{self.flag}={self.output} is being written by {_held_by(holder)} (lease {self.path}, until "
            f"{time.strftime('%H:%M:%S', time.localtime(float((holder or {}).get('expires', 0))))}); wait for it "
            f"to end, or write elsewhere")

    def acquire(self) -> None:
        holder = self._read()
        if holder and holder.get("token") != self._me["token"] and float(holder.get("expires", 0)) > time.time():
            self._refuse(holder)
        try:
            self._write()
        except Exception as e:  # noqa: BLE001 - each file system raises its own kind
            raise OutputLocationError(f"{self.flag}={self.output}: cannot write its lock {self.path} "
                                      f"({type(e).__name__}: {str(e)[:300]})") from None
        if (self._read() or {}).get("token") != self._me["token"]:  # another run wrote after us
            self._refuse(self._read())
        self._renewer = threading.Thread(target=self._renew, name=f"lease {self.path}", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self._write()
            except Exception as e:  # noqa: BLE001 - a missed renewal shortens the lease, no more
                _LOGGER.warning("could not renew the lease %s: %s", self.path, e)

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
            if (self._read() or {}).get("token") == self._me["token"]:
                with contextlib.suppress(Exception):
                    FileSystems.delete([self.path])


@contextlib.contextmanager
def locked(outputs: Iterable[tuple[str, str]]) -> Iterator[None]:
    """Hold the lock of every ``(flag, path)`` output while the block runs (see the module
    docstring); all or none: a refusal releases those already taken.

    Raises:
        OutputLockedError: another run holds one of them.
    """
    taken = []
    seen = set()
    try:
        for flag, output in outputs:
            path = lock_path(output)
            if path in seen:
                continue
            seen.add(path)
            lock = FileLock(path, flag=flag, output=output) if is_local(path) else \
                Lease(path, flag=flag, output=output)
            lock.acquire()
            taken.append(lock)
        yield
    finally:
        for lock in reversed(taken):
            try:
                lock.release()
            except Exception as e:  # noqa: BLE001 - releasing must not hide the run's own result
                _LOGGER.warning("could not release %s: %s", lock.path, e)
