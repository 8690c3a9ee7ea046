"""Paths of the pipelines' files, local or on any Beam FileSystem (``gs://``, ...): the few
operations publishing, the read/write check and fit's staging all need, written once."""

from __future__ import annotations

import fnmatch
import os
import posixpath
import stat
import time
import uuid

from apache_beam.io.filesystems import FileSystems

__all__ = ["is_local", "split", "join", "canonical", "inside", "matches", "entries", "regular_files", "new_run_tag",
           "RUN_TAG"]

# a staging folder's run part (publishing's and fit's): when, and a random tag
RUN_TAG = r"\d{8}-\d{6}-[0-9a-f]{8}"


def new_run_tag() -> str:
    """A run's `RUN_TAG`: its start time and a random tag."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def is_local(path: str) -> bool:
    return "://" not in path


def split(path: str) -> tuple[str, str]:
    """(directory, name) of a local path or a URL (``gs://b/x/y`` -> ``gs://b/x``, ``y``)."""
    if not is_local(path):
        head, _, name = path.rpartition("/")
        return head, name
    head, name = os.path.split(path)
    return head or ".", name


def join(directory: str, name: str) -> str:
    return os.path.join(directory, name) if is_local(directory) else posixpath.join(directory, name)


def canonical(path: str) -> str:
    """The one spelling of the file `path` names, for comparing paths as files: a local path
    absolute with every symbolic link of its existing part resolved (``L/x`` and ``D/x`` are
    one file when ``L`` links to ``D``); a URL (``gs://b//x/./y``) with its path part
    normalised (``gs://b/x/y``), as object stores have no links."""
    if is_local(path):
        return os.path.realpath(path)
    scheme, _, rest = path.partition("://")
    bucket, _, key = rest.partition("/")
    key = posixpath.normpath("/" + key).lstrip("/") if key.strip("/") else ""
    return f"{scheme}://{bucket}/{key}" if key else f"{scheme}://{bucket}"


def inside(path: str, directory: str) -> bool:
    """`path` is `directory` or lies under it, compared as files (`canonical`)."""
    path, directory = canonical(path), canonical(directory)
    if is_local(path) != is_local(directory):
        return False
    sep = os.sep if is_local(path) else "/"
    return path == directory or path.startswith(directory.rstrip(sep) + sep)


def matches(pattern: str) -> list[str]:
    """The paths Beam's FileSystems match for `pattern` (none where nothing is there, or
    the location cannot be listed)."""
    try:
        return [m.path for m in FileSystems.match([pattern])[0].metadata_list]
    except Exception:  # noqa: BLE001 - nothing there
        return []


def entries(directory: str, pattern: str) -> list[str]:
    """The names directly in `directory` matching `pattern`, files and folders (on an object
    store, the folders that objects under the pattern imply); none where nothing is there."""
    if is_local(directory):
        try:
            return [os.path.join(directory, n) for n in os.listdir(directory) if fnmatch.fnmatchcase(n, pattern)]
        except OSError:
            return []
    try:
        found = FileSystems.match([join(directory, pattern)])[0].metadata_list
        found += FileSystems.match([join(directory, pattern + "/**")])[0].metadata_list
    except Exception:  # noqa: BLE001 - nothing there
        return []
    base = directory.rstrip("/") + "/"
    return sorted({base + m.path[len(base):].split("/")[0] for m in found if m.path.startswith(base)})


def regular_files(paths: list[str], flag: str) -> list[str]:
    """`paths` (what an input flag matched), refused unless each local one is a regular file
    (symbolic links followed): reading a FIFO hangs, and a device such as /dev/zero never ends.

    Raises:
        ValueError: naming the flag and the first path that is not a regular file.
    """
    for path in paths:
        if not is_local(path):
            continue
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            raise ValueError(f"{flag}: {path} cannot be read ({e.strerror or e})") from None
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                    "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "not a regular file")
            raise ValueError(f"{flag}: {path} is {kind}; an input is a regular file (or a glob of them)")
    return paths
