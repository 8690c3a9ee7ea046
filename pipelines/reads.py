"""What a run reads, and the refusal of any output that would write onto it.

A run reads its input files, its task file(s), the trained head each task names and, when
routing, every task file of ``--task_dir``. At launch, before anything loads or is
staged, `refuse_overlap` refuses (exit 2, naming both flags) every output whose file is
one of those files, or whose reading pattern (``PREFIX-*.parquet`` of a sharded output)
matches one: publishing it would replace the file the run read, and the next run of the
same task would read a summary or a head where its input was. Outputs into a task
directory that the directory's pattern would pick up as a task are refused too. Local
paths are compared after resolving symbolic links; ``gs://`` and other Beam file systems
by their listed names.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
from typing import Iterable, Sequence

from beam_prefix.tasks.task_file import read_task_file
from pipelines.options import SAMPLE_TICKETS, StepOptions
from pipelines.paths import is_local, matches, split
from pipelines.publish import Output, OutputLocationError

__all__ = ["Read", "input_reads", "task_reads", "refuse_overlap", "files_of"]

TASK_PATTERNS = ("*.yaml", "*.yml")  # what --task_dir reads (beam_prefix.beam.routing.load_tasks)


@dataclasses.dataclass(frozen=True)
class Read:
    """Files a run reads.

    Attributes:
        flag: where the files come from, for messages (``--input``, ``--task``, ...).
        pattern: a file path or a glob (local or a Beam file system's URL).
        directory_pattern: the pattern also names files that do not exist yet but would be
            read by the next run (a task directory's ``*.yaml``).
    """

    flag: str
    pattern: str
    directory_pattern: bool = False


def _norm(path: str) -> str:
    return path if not is_local(path) else os.path.realpath(path)


def files_of(pattern: str) -> list[str]:
    """The existing files `pattern` names, normalised (local: symbolic links resolved)."""
    if not is_local(pattern):
        return matches(pattern)  # (nothing there, or not listable: nothing to overwrite)
    return sorted({_norm(p) for p in glob.glob(pattern) if os.path.isfile(p)})


def _writes(output: Output, file: str) -> bool:
    """`output` would write (or its readers would glob) the existing file `file`."""
    directory, name = split(file)
    if output.suffix is None:
        return _norm(output.path) == file
    return _norm(output.directory) == directory and output.reads(name)


def _head_of(task_file: str) -> str | None:
    """The head file a task file names (relative to the task file), without validating it:
    a bad task file is reported by the step that builds the task."""
    try:
        data = read_task_file(task_file)
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    head = data.get("head") if isinstance(data, dict) else None
    if not isinstance(head, str) or not head:
        return None
    return head if os.path.isabs(head) or not is_local(head) else os.path.join(os.path.dirname(task_file), head)


def input_reads(options) -> list[Read]:
    """The input files a run's flags name (the shipped sample when no input is given)."""
    o = options.view_as(StepOptions)
    if o.input:
        return [Read("--input", o.input)]
    return [] if (o.input_table or o.input_query) else [Read("the sample input", SAMPLE_TICKETS)]


def task_reads(task_file: str | None, *, task_dir: str | None = None, with_head: bool = True) -> list[Read]:
    """What a task flag reads: the task file and the head it names, or a task directory's
    task files (the files there now, and any a later run would pick up) and their heads."""
    reads = []
    task_file = None if task_file is None else os.fspath(task_file)
    if task_file:
        reads.append(Read("--task", task_file))
        head = _head_of(task_file) if with_head else None
        if head:
            reads.append(Read(f"the head of --task={task_file}", head))
    if task_dir:
        task_dir = os.fspath(task_dir)
        for pattern in TASK_PATTERNS:
            reads.append(Read("--task_dir", os.path.join(task_dir, pattern), directory_pattern=True))
            for f in files_of(os.path.join(task_dir, pattern)):
                head = _head_of(f)
                if head:
                    reads.append(Read(f"the head of task file {f}", head))
    return reads


def refuse_overlap(outputs: Sequence[Output], reads: Iterable[Read]) -> None:
    """Refuse any output that would write a file the run reads (see the module docstring).

    Raises:
        OutputLocationError: naming the output's flag and path and what reads the file.
    """
    for read in reads:
        for file in files_of(read.pattern):
            for output in outputs:
                if _writes(output, file):
                    raise OutputLocationError(
                        f"{output.flag}={output.path} would write {file}, which this run reads "
                        f"({read.flag}={read.pattern}); a run never writes what it reads: choose another "
                        f"output path")
        if not read.directory_pattern:
            continue
        directory, pattern = split(read.pattern)
        for output in outputs:
            if _norm(output.directory) == _norm(directory) and fnmatch.fnmatchcase(output.example(), pattern):
                raise OutputLocationError(
                    f"{output.flag}={output.path} would write {output.example()} into {directory}, which "
                    f"{read.flag} reads as a task file ({pattern}); write it elsewhere")
