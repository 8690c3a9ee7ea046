"""Locks beside a run's outputs, so that two runs into the same output are never both told
that their rows were written.

Every pipeline takes, at launch and before anything is staged or loaded, one lock per
output it writes: a file ``.beam-prefix-lock-<name>`` beside the output. A second run into
an output that is locked is refused (`OutputLockedError`, exit 2) with the holder's pid,
host and start time. The lock is released when the run ends, whatever its outcome, and the
lock file is removed then.

- Local outputs: an exclusive ``flock`` on the lock file. The kernel releases it when the
  process dies, however it dies (``kill -9`` included), so a killed run never leaves it
  held: the next run takes it (and removes the file when it ends). The file is created
  and opened without following links; anything at its path that is not a lock file (a
  link, a directory, a FIFO, a hard link, a file of other content) is refused at launch
  and left as it is (`FileLock`).
- Two spellings of one output (``L/out`` where ``L`` links to ``D``, and ``D/out``) are one
  output with one lock: the lock's folder is compared as a file (`paths.canonical`).
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
import stat
import threading
import time
import uuid
from typing import Iterable, Iterator

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from beam_prefix.pipelines.paths import canonical, is_local, join, split
from beam_prefix.pipelines.publish import OutputLocationError

__all__ = ["OutputLockedError", "LOCK_PREFIX", "LEASE_S", "lock_path", "locked", "FileLock", "Lease"]

_LOGGER = logging.getLogger(__name__)
LOCK_PREFIX = ".beam-prefix-lock-"
LEASE_S = 600.0  # a remote lease's life without renewal: how long a killed run's lease holds


class OutputLockedError(OutputLocationError):
    """Another run is writing the same output."""


def lock_path(output: str) -> str:
    """The lock file of the output at `output` (a file, a sharded prefix or a directory)."""
    # (the folder as a file, `canonical`: two spellings of one output share one lock)
    directory, name = split(output.rstrip("/") if not is_local(output) else os.path.abspath(output))
    return join(canonical(directory), LOCK_PREFIX + name)


def _owner() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "token": uuid.uuid4().hex}


def _held_by(info: dict | None) -> str:
    if not info:
        return "another run"
    return f"run {info.get('pid')} on {info.get('host')}, started {info.get('since')}"


class FileLock:
    """An exclusive ``flock`` on a local lock file (see the module docstring).

    The lock file is created with ``O_EXCL | O_NOFOLLOW``, so a run never writes through a
    link. An existing file at the lock's path is taken only when it is a lock: a regular file
    with one name that holds a run's lock record, or nothing (an earlier run killed outright
    left it; ``flock`` tells a live holder from a dead one). Anything else there (a symbolic
    link, a directory, a FIFO, a hard link of another file, a file of other content, one this
    user cannot write) is refused, naming the lock's path and what is there; the run never
    truncates or removes it. When the run ends it removes the lock file only if the path
    still names the file it locked.

    Args:
        path: the lock file. flag, output: named in the refusal.
    """

    RETRIES = 100  # a lock file that vanishes between our open and our lock: another run ended

    def __init__(self, path: str, *, flag: str, output: str):
        self.path, self.flag, self.output = path, flag, output
        self._fd: int | None = None
        self._made: list[str] = []  # folders the lock created, deepest first: removed if left empty

    def _refuse(self, what: str) -> None:
        raise OutputLocationError(
            f"{self.flag}={self.output}: its lock path {self.path} is {what}, not a beam-prefix lock; a run never "
            f"writes through or over it: remove it, or write elsewhere")

    def _open(self) -> tuple[int, bool] | None:
        """(fd, created) of the lock file, opened without following links; None when it
        vanished between two looks (retry). Refuses what is not a lock file."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            pass
        except FileNotFoundError:  # a run that made the folder removed it, empty, as it ended
            return None
        except OSError as e:
            self._cannot_write(e)
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode):
            self._refuse(_kind(self.path, info))
        try:
            fd = os.open(self.path, flags)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a link put there since we looked
                self._refuse(_kind(self.path, os.lstat(self.path)))
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                self._refuse(f"a file this run cannot write ({e.strerror}: immutable, read-only or not yours)")
            self._cannot_write(e)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            self._refuse(_kind(self.path, info) if not stat.S_ISREG(info.st_mode) else
                         f"a hard link (the file has {info.st_nlink - 1} other name(s), which writing it would change)")
        return fd, False

    def _cannot_write(self, e: OSError) -> None:  # (as `Staging.preflight` says it, which would come next)
        raise OutputLocationError(f"{self.flag}={self.output}: cannot write its lock {self.path} "
                                  f"({type(e).__name__}: {e.strerror or e})") from None

    def acquire(self) -> None:
        import fcntl

        folder = os.path.abspath(os.path.dirname(self.path) or ".")
        while not os.path.lexists(folder):
            self._made.append(folder)
            folder = os.path.dirname(folder)
        for _ in range(self.RETRIES):
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            except OSError as e:
                self._cannot_write(e)
            opened = self._open()
            if opened is None:
                continue
            fd, created = opened
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
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            if not created and not _is_lock_record(os.pread(fd, 4097, 0)):
                os.close(fd)  # (a file of someone's that happens to have the lock's name)
                self._refuse("a file that holds something else")
            break
        else:
            raise OutputLocationError(f"{self.flag}={self.output}: its lock {self.path} kept vanishing while this "
                                      f"run took it ({self.RETRIES} tries); try again")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_owner()).encode("utf-8"), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # while still held: a run waiting to open it opens a new file
            if os.path.samestat(os.fstat(self._fd), os.lstat(self.path)):  # only the file we locked
                os.remove(self.path)
        os.close(self._fd)
        self._fd = None
        for folder in self._made:  # a run refused or failed leaves no folder it made (rmdir: only when empty)
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _kind(path: str, info: os.stat_result) -> str:
    """What is at `path` (its ``lstat``), in words."""
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(path)!r})"
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a regular file" if stat.S_ISREG(mode) else "not a regular file")


def _is_lock_record(data: bytes) -> bool:
    """`data` is what a lock file holds: a run's owner record, or nothing (a run killed
    between creating the file and writing it)."""
    if not data.strip():
        return True
    try:
        record = json.loads(data.decode("utf-8"))
    except ValueError:
        return False
    return isinstance(record, dict) and {"pid", "host", "since", "token"} <= set(record)


def _read_local(path: str) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        record = json.loads(os.read(fd, 4096).decode("utf-8") or "null")
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


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
