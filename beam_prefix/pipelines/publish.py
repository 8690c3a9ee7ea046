"""All-or-nothing file outputs: stage a run's files, publish them only when it succeeds.

Beam finalizes each file sink on its own, so a run that fails late (the failed-rows write,
the summary) could leave the labelled files final beside no summary. Instead every file
output of a run (labelled, failed, summary, confusion PNG) is written into a hidden
staging directory beside its final location, and:

- `Staging.check` (at launch, before the model loads) refuses two outputs whose files
  could collide (one would replace the other, or a reader's ``PREFIX-*.parquet`` would
  mix them), and a single-file output that names a directory;
- `Staging.preflight` (at launch) creates each local staging directory and writes a
  probe file there;
- `Staging.publish` (once the run and its summary are done) checks every target before
  the first rename, moves aside the files it replaces and the *stale shards* of each
  sharded output (an earlier run's ``PREFIX-00002-of-00003.parquet`` when this run wrote
  one shard), renames the staged files into place, and only then deletes what it moved
  aside. If a rename fails, everything already moved is moved back (the earlier files
  restored); if even that fails, the error names exactly which files are final;
- `Staging.discard` removes the staging directories (Beam's ``beam-temp-*`` too) when
  anything failed;
- `Staging.remove_stale` (at launch, with the outputs' locks held: `pipelines.output_lock`)
  removes the staging directories an earlier run into the same outputs left when it was
  killed outright. A staging directory is named after one of its run's outputs
  (``.beam-prefix-staging-<output name>-<run>``), so a run removes only what a run into
  its own, locked, outputs left.

BigQuery tables are not staged: see docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import logging
import os
import re

from apache_beam.io.filesystems import FileSystems

from beam_prefix.pipelines.paths import (RUN_TAG, canonical, entries, is_local as _local, join as _join, new_run_tag,
                                        split as _split)

__all__ = ["Output", "Staging", "OutputLocationError", "PublishError", "SHARD_TEMPLATE"]

_LOGGER = logging.getLogger(__name__)
STAGING_PREFIX = ".beam-prefix-staging-"
_REPLACED = ".replaced"  # inside a staging directory: files a publish moved aside
# Beam's default shard name template (-SSSSS-of-NNNNN): 5 digits, more past 99,999 shards
SHARD_TEMPLATE = r"-\d{5,}-of-\d{5,}"


class OutputLocationError(ValueError):
    """An output location that cannot be written; names the flag that chose it."""


class PublishError(OSError):
    """Publishing the staged files failed.

    Attributes:
        final: the files left final at their destination (empty when everything was
            moved back and nothing was published).
    """

    def __init__(self, message: str, final: list[str]):
        super().__init__(message)
        self.final = final


def _same_dir(a: str, b: str) -> bool:
    """Two directories are one, compared as files (``L`` a link to ``D``: the same), not spellings."""
    return canonical(a) == canonical(b)


@dataclasses.dataclass(frozen=True)
class Output:
    """One file output of a run.

    Attributes:
        flag: the flag that chose it (named in messages), e.g. ``--output``.
        path: a sharded sink's path prefix, or a single file's path.
        suffix: a sharded sink's file suffix (``.parquet``); None for a single file.
    """

    flag: str
    path: str
    suffix: str | None = None

    @property
    def directory(self) -> str:
        return _split(self.path)[0]

    @property
    def name(self) -> str:
        return _split(self.path)[1]

    @property
    def pattern(self) -> str:
        """What a reader globs for this output's files (``PREFIX-*.parquet``)."""
        return self.path if self.suffix is None else f"{self.path}-*{self.suffix}"

    def example(self) -> str:
        """The name of one file this output writes."""
        return self.name if self.suffix is None else f"{self.name}-00000-of-00001{self.suffix}"

    def reads(self, name: str) -> bool:
        """A file called `name` in this output's directory matches its pattern."""
        return name == self.name if self.suffix is None else fnmatch.fnmatchcase(name, f"{self.name}-*{self.suffix}")

    def shard(self, name: str) -> bool:
        """`name` is one of this sharded output's shard files (any shard count)."""
        return self.suffix is not None and re.fullmatch(
            re.escape(self.name) + SHARD_TEMPLATE + re.escape(self.suffix), name) is not None


class Staging:
    """Staged paths for a run's file outputs.

    Args:
        outputs: the run's file outputs (`Output`).
    """

    def __init__(self, outputs: list[Output]):
        run = new_run_tag()
        self.outputs = list(outputs)
        self._keep = False
        # final directory (`canonical`: two spellings of one folder share it) -> its staging directory
        self._dirs: dict[str, str] = {}
        for output in self.outputs:  # (named after the directory's first output: `remove_stale`)
            final_dir = canonical(output.directory)
            self._dirs.setdefault(final_dir, _join(final_dir, f"{STAGING_PREFIX}{output.name}-{run}"))

    def path(self, final: str) -> str:
        """Where a file (or a sink's prefix) that belongs at `final` is written during the run."""
        final_dir, name = _split(final)
        return _join(self._dirs[canonical(final_dir)], name)  # KeyError: not a location given at construction

    def check(self) -> None:
        """Refuse outputs that would collide, and a single file that names a directory.

        Raises:
            OutputLocationError: naming both flags (or the flag and the directory).
        """
        for a, b in itertools.combinations(self.outputs, 2):
            if _same_dir(a.directory, b.directory) and (a.reads(b.example()) or b.reads(a.example())):
                same = (a.name, a.suffix) == (b.name, b.suffix)  # (in one directory, as files)
                raise OutputLocationError(
                    f"{a.flag}={a.path} and {b.flag}={b.path} "
                    + ("write the same files: one would replace the other" if same else
                       f"write files that {a.pattern if a.reads(b.example()) else b.pattern} matches: a reader of "
                       f"one would get the other's rows too")
                    + "; give them different names")
        for output in self.outputs:
            if output.suffix is None and _local(output.path) and os.path.isdir(output.path):
                raise OutputLocationError(f"{output.flag}={output.path} is a directory; give a file path")

    def remove_stale(self) -> list[str]:
        """Remove the staging directories of earlier runs into these outputs that were
        killed before they could (call with the outputs' locks held); returns them."""
        removed = []
        for final_dir, own in self._dirs.items():
            names = [re.escape(o.name) for o in self.outputs if _same_dir(o.directory, final_dir)]
            stale = re.compile(re.escape(STAGING_PREFIX) + f"({'|'.join(names)})-{RUN_TAG}")
            for entry in entries(final_dir, STAGING_PREFIX + "*"):
                if _local(entry) and os.path.islink(entry):
                    continue  # a run made a directory, never a link: not one of ours, never followed
                if entry != own and stale.fullmatch(_split(entry)[1]):
                    _LOGGER.info("removing %s, left by an earlier run into the same output that was killed", entry)
                    try:
                        FileSystems.delete([entry])
                        removed.append(entry)
                    except Exception as e:  # noqa: BLE001 - litter, not this run's concern
                        _LOGGER.warning("could not remove %s: %s", entry, e)
        return removed

    def preflight(self) -> None:
        """Create each local staging directory and write a probe file there.

        Raises:
            OutputLocationError: naming the flag and path that cannot be written.
        """
        for output in self.outputs:
            final_dir = output.directory
            if not _local(final_dir):
                continue  # remote: checked by the runner (credentials live there)
            staging = self._dirs[canonical(final_dir)]
            probe = os.path.join(staging, ".probe")
            try:
                os.makedirs(staging, exist_ok=True)
                with open(probe, "wb") as f:
                    f.write(b"ok")
                os.remove(probe)
            except OSError as e:
                self.discard()
                raise OutputLocationError(f"{output.flag}={output.path}: cannot write to {final_dir!r} "
                                          f"({type(e).__name__}: {e.strerror or e})") from None

    def publish(self) -> list[str]:
        """Move every staged file into place, all or nothing (see the module docstring);
        remove the staging directories.

        Returns:
            the final paths of the published files.
        Raises:
            PublishError: nothing was published (everything moved back), or, if moving
                back failed too, naming the files that are final.
        """
        moves = []  # (staged file, its final path)
        for final_dir, staging in self._dirs.items():
            moves += [(f, _join(final_dir, _split(f)[1])) for f in _list(staging)]
        moves.sort(key=lambda move: move[1])
        targets = {final for _, final in moves}
        blocked = [final for final in sorted(targets) if _local(final) and os.path.isdir(final)]
        if blocked:  # before the first rename: nothing moves
            raise PublishError(f"cannot publish: {blocked[0]} is a directory (where an output file goes); "
                               f"nothing was published", final=[])
        aside = sorted({f for f in targets if _exists(f)} | set(self._stale(targets)))
        done: list[tuple[str, str]] = []  # moves made, undone in reverse on failure
        try:
            for f in aside:  # replaced files and stale shards: kept until the new files are all in place
                backup = _join(_join(self._dirs[_split(f)[0]], _REPLACED), _split(f)[1])
                _move(f, backup)
                done.append((f, backup, False))
            for staged, final in moves:
                _move(staged, final)
                done.append((staged, final, True))
        except Exception as e:  # noqa: BLE001 - any failure: undo, then say what is final
            final, lost = self._undo(done)
            where = f"{type(e).__name__}: {e}"
            if final or lost:
                self._keep = bool(lost)  # the staging directories hold the earlier files not restored
                raise PublishError(f"publishing failed ({where}) and could not be undone: these files are final: "
                                   f"{final}" + (f"; earlier files not restored, kept at {lost}" if lost else ""),
                                   final=final) from e
            raise PublishError(f"publishing failed ({where}); every file already moved was moved back, "
                               f"nothing was published", final=[]) from e
        if aside:
            _LOGGER.info("replaced %d earlier file(s) (stale shards of the same prefix removed)", len(aside))
        self.discard()  # the moved-aside files go with the staging directories
        return sorted(targets)

    def _stale(self, targets: set[str]) -> list[str]:
        """Shard files of this run's sharded outputs already at the destination that this
        run does not write (an earlier run with another shard count)."""
        stale = []
        for output in self.outputs:
            if output.suffix is None:
                continue
            for m in _list(canonical(output.directory), f"{output.name}-*{output.suffix}"):
                name = _split(m)[1]
                if output.shard(name) and m not in targets:
                    stale.append(m)
        return stale

    @staticmethod
    def _undo(done: list[tuple[str, str, bool]]) -> tuple[list[str], list[str]]:
        """Move back what `done` moved (``(src, dst, new)``), newest first. Returns the new
        files still final, and where earlier files that could not be restored are."""
        final, lost = [], []
        for src, dst, new in reversed(done):
            try:
                _move(dst, src)
            except Exception as e:  # noqa: BLE001 - keep undoing the rest
                _LOGGER.error("could not move %s back to %s: %s", dst, src, e)
                (final if new else lost).append(dst)
        return sorted(final), sorted(lost)

    def discard(self) -> None:
        """Remove the staging directories and all they hold (a failed run's files, Beam's temp dirs)."""
        if self._keep:
            return
        for staging in self._dirs.values():
            try:
                if FileSystems.exists(staging):
                    FileSystems.delete([staging])
            except Exception as e:  # noqa: BLE001 - cleanup must not hide the run's own error
                _LOGGER.warning("could not remove the staging directory %s: %s", staging, e)


def _exists(path: str) -> bool:
    return os.path.lexists(path) if _local(path) else FileSystems.exists(path)


def _move(src: str, dst: str) -> None:
    if _local(src):
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        os.replace(src, dst)
    else:
        FileSystems.rename([src], [dst])


def _list(directory: str, pattern: str = "*") -> list[str]:
    """The files directly in `directory` matching `pattern` (not Beam's ``beam-temp-*``
    directories, nor any other directory)."""
    try:
        metadata = FileSystems.match([_join(directory, pattern)])[0].metadata_list
    except Exception:  # noqa: BLE001 - nothing written there
        return []
    return [m.path for m in metadata if not _split(m.path)[1].startswith("beam-temp")
            and not (_local(m.path) and os.path.isdir(m.path))]
