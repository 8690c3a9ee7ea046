"""Paths of the pipelines' files, local or on any Beam FileSystem (``gs://``, ...): the few
operations publishing, the read/write check and fit's staging all need, written once."""

from __future__ import annotations

import os
import posixpath

from apache_beam.io.filesystems import FileSystems

__all__ = ["is_local", "split", "join", "matches"]


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


def matches(pattern: str) -> list[str]:
    """The paths Beam's FileSystems match for `pattern` (none where nothing is there, or
    the location cannot be listed)."""
    try:
        return [m.path for m in FileSystems.match([pattern])[0].metadata_list]
    except Exception:  # noqa: BLE001 - nothing there
        return []
