"""The tasks and sample data shipped inside the package, found by name wherever it is installed.

The files live in the package's data folder `beam_prefix/shipped/` (``tasks/``, ``data/``,
``yaml/``), located with `importlib.resources`, so a name such as ``support_tickets`` or
``banking77_head`` means the same file in a checkout, in an installed wheel and on a Beam
worker. `resolve_task` is the one rule every reader of a task (``TaskSpec.from_yaml``,
``load_task``, the transforms, the CLIs) applies: a bare name that is a shipped task is that
task's file; anything else is a path, as given.
"""

from __future__ import annotations

import difflib
import os
import pathlib
from importlib import resources

from beam_prefix.errors import TaskSpecError

__all__ = ["SHIPPED_TASKS", "shipped_tasks", "shipped_task_path", "shipped_data_path", "resolve_task", "is_task_name"]

_TASK_SUFFIXES = (".yaml", ".yml")


def _shipped_dir(folder: str) -> pathlib.Path:
    """The shipped folder ``folder`` as a real directory (Beam and the model loaders read paths)."""
    root = resources.files("beam_prefix.shipped")
    if not isinstance(root, pathlib.Path):  # a zipped install: the task files' heads need real paths
        raise TaskSpecError(f"beam_prefix is installed where its shipped files are not plain files ({root}); "
                            f"install the package unzipped (pip install beam-prefix does)")
    return root / folder


# The shipped task names: a fixed list, not what the folder holds, so a file dropped into
# ``shipped/tasks`` (by a user, or a run) never becomes a name every user's runs resolve
# (a test holds the list to the files the package ships).
SHIPPED_TASKS = ("banking77", "banking77_fast_head", "banking77_head", "support_tickets", "support_tickets_head",
                 "ticket_fields", "ticket_fields_head")


def shipped_tasks() -> list[str]:
    """The names of the tasks shipped with the package, sorted: each works wherever a task is
    taken (``TaskSpec.from_yaml``, ``PrefixClassifier.load``, ``ClassifyText``, Beam YAML, the CLIs)."""
    return sorted(SHIPPED_TASKS)


def shipped_task_path(name: str) -> str:
    """The file of the shipped task ``name``.

    Raises:
        TaskSpecError: no shipped task has that name (the message lists them).
    """
    path = _shipped_dir("tasks") / f"{name}.yaml"
    if name not in SHIPPED_TASKS or not path.is_file():
        close = difflib.get_close_matches(name, shipped_tasks(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TaskSpecError(f"no shipped task {name!r} and no such file{hint} "
                            f"(shipped tasks: {', '.join(shipped_tasks())}; or give a task file's path)")
    return str(path)


def shipped_data_path(name: str) -> str:
    """A sample data file shipped with the package (``sample_tickets.parquet``, ``heldout_tickets.csv``...)."""
    return str(_shipped_dir("data") / name)


def is_task_name(task: str) -> bool:
    """Whether ``task`` reads as a name rather than a path: no folder separator and no
    ``.yaml``/``.yml`` suffix (``support_tickets``, not ``./support_tickets.yaml``)."""
    return bool(task) and "/" not in task and os.sep not in task and not task.endswith(_TASK_SUFFIXES)


def resolve_task(task: str | os.PathLike) -> str:
    """A task given as a shipped name or a path, as the path to read.

    A bare name (`is_task_name`) that a shipped task has is that task's file (as the CLIs
    have always read ``--task support_tickets``; write ``./NAME`` for a local file of the same
    name); any other task is a path, as given. A bare name that is neither a shipped task nor
    an existing file is an error listing the shipped tasks, where reading it would only say
    "no such file".
    """
    task = os.fspath(task)
    if not is_task_name(task) or (os.path.isfile(task) and task not in shipped_tasks()):
        return task
    return shipped_task_path(task)
