"""All-or-nothing file outputs: stage a run's files, publish them only when it succeeds.

Beam finalizes each file sink on its own, so a run that fails late (the failed-rows write,
the summary) could leave the labelled files final beside no summary. Instead every file
output of a run (labelled, failed, summary, confusion PNG) is written into a hidden
staging directory beside its final location; `Staging.publish` renames the staged files
into place once the run and its summary are done, and `Staging.discard` removes the
staging directories (Beam's ``beam-temp-*`` directories inside them too) when anything
failed. `Staging.preflight` checks, before the model loads, that each local location
can be created and written. BigQuery tables are not staged: a table load is its own
transaction, written by Beam at the end of the run.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
import uuid

from apache_beam.io.filesystems import FileSystems

__all__ = ["Staging", "OutputLocationError"]

_LOGGER = logging.getLogger(__name__)
STAGING_PREFIX = ".beam-prefix-staging-"


class OutputLocationError(ValueError):
    """An output location that cannot be written; names the flag that chose it."""


def _split(path: str) -> tuple[str, str]:
    """(directory, name) of a local path or a URL (``gs://b/x/y`` -> ``gs://b/x``, ``y``)."""
    if "://" in path:
        head, _, name = path.rpartition("/")
        return head, name
    head, name = os.path.split(path)
    return head or ".", name


def _join(directory: str, name: str) -> str:
    return posixpath.join(directory, name) if "://" in directory else os.path.join(directory, name)


class Staging:
    """Staged paths for a run's file outputs, keyed by the flag that chose each location.

    Args:
        outputs: ``{flag: final path}`` (a path prefix for sharded sinks, a file path for
            the summary); e.g. ``{"--output": "out/labeled", "--summary_output": ...}``.
    """

    def __init__(self, outputs: dict[str, str]):
        run = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self._flags = dict(outputs)
        self._dirs: dict[str, str] = {}  # final directory -> its staging directory
        for path in outputs.values():
            final_dir, _ = _split(path)
            self._dirs.setdefault(final_dir, _join(final_dir, STAGING_PREFIX + run))

    def path(self, final: str) -> str:
        """Where a file (or a sink's prefix) that belongs at `final` is written during the run."""
        final_dir, name = _split(final)
        return _join(self._dirs[final_dir], name)  # KeyError: not a location given at construction

    def preflight(self) -> None:
        """Create each local staging directory and write a probe file there.

        Raises:
            OutputLocationError: naming the flag and path that cannot be written.
        """
        for flag, final in self._flags.items():
            final_dir, _ = _split(final)
            if "://" in final_dir:
                continue  # remote: checked by the runner (credentials live there)
            staging = self._dirs[final_dir]
            probe = os.path.join(staging, ".probe")
            try:
                os.makedirs(staging, exist_ok=True)
                with open(probe, "wb") as f:
                    f.write(b"ok")
                os.remove(probe)
            except OSError as e:
                self.discard()
                raise OutputLocationError(f"{flag}={final}: cannot write to {final_dir!r} "
                                          f"({type(e).__name__}: {e.strerror or e})") from None

    def publish(self) -> list[str]:
        """Rename every staged file into its final directory; remove the staging directories.

        Returns:
            the final paths of the published files.
        """
        published = []
        for final_dir, staging in self._dirs.items():
            files = [m.path for m in _list(staging)]
            if files:
                destinations = [_join(final_dir, _split(f)[1]) for f in files]
                FileSystems.rename(files, destinations)
                published += destinations
        self.discard()
        return sorted(published)

    def discard(self) -> None:
        """Remove the staging directories and all they hold (a failed run's files, Beam's temp dirs)."""
        for staging in self._dirs.values():
            try:
                if FileSystems.exists(staging):
                    FileSystems.delete([staging])
            except Exception as e:  # noqa: BLE001 - cleanup must not hide the run's own error
                _LOGGER.warning("could not remove the staging directory %s: %s", staging, e)


def _list(directory: str):
    """The files directly in `directory` (not Beam's ``beam-temp-*`` directories)."""
    try:
        metadata = FileSystems.match([_join(directory, "*")])[0].metadata_list
    except Exception:  # noqa: BLE001 - nothing written there
        return []
    return [m for m in metadata if not _split(m.path)[1].startswith("beam-temp")
            and not ("://" not in m.path and os.path.isdir(m.path))]
