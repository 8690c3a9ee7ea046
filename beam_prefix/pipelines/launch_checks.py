"""Launch checks: what a run reads against what it writes, refused before anything loads.

Every pipeline (`pipelines.classify`, `extract`, `fit`, `tune`, and the Flex Templates,
which run the same commands) makes these checks at launch, before the model loads or any
output is staged; each refusal is exit 2 with one line naming the flag(s):

- `refuse_overlap`: no output writes a file the run reads. A run reads its input files,
  its task file(s), the trained head each names, every task file of ``--task_dir`` (and a
  new file such a directory would read as a task next time), and its model: every file of
  a local model directory but heads and task files, the names a model loader reads there
  even before they exist (``config.json``, ``*.safetensors``, tokenizer files, a tuned
  directory's record, ...), a ``.gguf`` file, the embedded model's converted directory.
  An output "writes" a file when its path is that file or its reading pattern
  (``PREFIX-*.parquet`` of a sharded output) matches it. Every path is compared as the
  file it names (`paths.canonical`): local paths with the symbolic links of their existing
  part resolved, ``gs://`` and other Beam file systems with their path part normalised.
- `refuse_table_overlap`: no output table is the input table.
- `refuse_collisions`: no two outputs write the same files (`publish.Staging.check`), and
  `refuse_inside`: no output file lies inside an output directory (`pipelines.tune`).
- `refuse_package`: no output lies inside the installed ``beam_prefix`` package (its shipped
  tasks, heads and data), compared as files; part of `refuse_overlap`.
- `refuse_unreachable`: every remote path the run names (``gs://`` outputs, input, task,
  model, and the heads its task files name: `remote_heads`) answers within
  `REMOTE_TIMEOUT_S` (30 s; ``BEAM_PREFIX_REMOTE_TIMEOUT_S``), before any other check reads
  it: an unreachable bucket is one line naming the flag, not minutes of a client's retries
  and then its raw error.
- `hold_outputs`: no other run is writing the same outputs (`pipelines.output_lock`; taken
  after these checks, held until the run ends).

Checks of other things live with what they check: flag combinations in
`pipelines.options.validate`; inputs that are not regular files, and CSV headers, in
`pipelines.sources` and `pipelines.paths.regular_files`; outputs that cannot be written in
`publish.Staging.preflight`; hidden-state layers in `beam_prefix.model.early_exit.check_layers`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import glob
import os
from typing import Iterable, Sequence

from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix.model.loading import EMBEDDED, embedded_cache_directory
from beam_prefix.model.tuning_record import TUNING_FILE
from beam_prefix.tasks.shipped import resolve_task
from beam_prefix.tasks.task_file import read_task_file
from beam_prefix.pipelines.options import DEFAULT_TASKS, SAMPLE_TICKETS, ClassifyOptions, StepOptions
from beam_prefix.pipelines.output_lock import locked
from beam_prefix.pipelines.paths import canonical, inside, is_local, join, matches, split
from beam_prefix.pipelines.publish import Output, OutputLocationError, Staging

__all__ = ["Read", "input_reads", "task_reads", "model_reads", "run_reads", "run_models", "refuse_overlap", "refuse_table_overlap",
           "refuse_collisions", "refuse_inside", "refuse_package", "package_directory", "hold_outputs", "files_of",
           "refuse_unreachable", "remote_paths", "remote_heads", "REMOTE_TIMEOUT_S"]

HEAD = "a trained head"  # the role of a head a task file names (`remote_heads`)
TASK_PATTERNS = ("*.yaml", "*.yml")  # what --task_dir reads (beam_prefix.beam.routing.load_tasks)
# what a model loader (transformers, and this package's tuning record) reads in a model
# directory: refused as outputs there even before such a file exists
MODEL_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin",
                  "*.pt", "*.pth", "*.gguf", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                  "merges.txt", "*.model", "chat_template.*", "*.py", "preprocessor_config.json", TUNING_FILE)
# files of a model directory that are not the model's: a tuned directory's head and task file
# (a fit may replace a head; the task reads cover the head a run answers with)
NOT_MODEL_FILES = ("*.head", "*.yaml", "*.yml", ".*")


@dataclasses.dataclass(frozen=True)
class Read:
    """Files a run reads.

    Attributes:
        flag: where the files come from, for messages (``--input``, ``--task``, ...).
        pattern: a file path or a glob (local or a Beam file system's URL).
        directory_pattern: the pattern also names files that do not exist yet but would be
            read by the next run (a task directory's ``*.yaml``, a model's ``config.json``).
        role: what such a new file would be read as, for messages.
    """

    flag: str
    pattern: str
    directory_pattern: bool = False
    role: str = "a task file"


_norm = canonical  # every path is compared as the file it names, not as spelled


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
    data = _task_data(task_file)
    head = data.get("head")
    if not isinstance(head, str) or not head:
        return None
    return head if os.path.isabs(head) or not is_local(head) else os.path.join(os.path.dirname(task_file), head)


def _task_data(task_file: str) -> dict:
    try:
        data = read_task_file(task_file)
    except Exception:  # noqa: BLE001 - a bad task file is reported by the step that reads it
        return {}
    return data if isinstance(data, dict) else {}


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
            reads.append(Read(f"the head of --task={task_file}", head, role=HEAD))
    if task_dir:
        task_dir = os.fspath(task_dir)
        for pattern in TASK_PATTERNS:
            reads.append(Read("--task_dir", os.path.join(task_dir, pattern), directory_pattern=True))
            for f in files_of(os.path.join(task_dir, pattern)):
                head = _head_of(f)
                if head:
                    reads.append(Read(f"the head of task file {f}", head, role=HEAD))
    return reads


def model_reads(model: str, flag: str = "--model") -> list[Read]:
    """What loading `model` reads: a local or remote model directory's files (see the module
    docstring), a ``.gguf`` file, or the embedded model's converted directory; nothing for a
    hub id (the hub's cache is not a place a run's outputs go)."""
    if model.endswith(".gguf"):
        return [Read(flag, model)]
    directory = embedded_cache_directory() if model == EMBEDDED else model.rstrip("/") if not is_local(model) else model
    if model != EMBEDDED and is_local(model) and not os.path.isdir(model):
        return []  # a hub id
    reads = [Read(flag, join(directory, pattern), directory_pattern=True, role="a model file")
             for pattern in MODEL_PATTERNS]
    for file in files_of(join(directory, "*")):
        if not any(fnmatch.fnmatchcase(split(file)[1], p) for p in NOT_MODEL_FILES):
            reads.append(Read(flag, file))
    return reads


def _models(options: PipelineOptions, task_files: Sequence[str]) -> list[str]:
    """The models a run loads: --model, else each task's own, else the embedded model."""
    given = options.view_as(StepOptions).model
    if given:
        return [given]
    named = [_task_data(f).get("model") for f in task_files]
    return sorted({m if isinstance(m, str) and m else EMBEDDED for m in named} or {EMBEDDED})


def run_models(options: PipelineOptions, kind: str, *, task_file: str | None = None) -> list[str]:
    """The models a run loads (--model, else each of its tasks' own, else the embedded model)."""
    c = options.view_as(ClassifyOptions)
    if kind == "classify" and c.task_dir:
        task_files = [f for pattern in TASK_PATTERNS for f in files_of(os.path.join(c.task_dir, pattern))]
    else:
        o = options.view_as(StepOptions)
        task_files = [task_file or resolve_task(o.task or DEFAULT_TASKS.get(kind, DEFAULT_TASKS["classify"]))]
    return _models(options, task_files)


def run_reads(options: PipelineOptions, kind: str, *, task_file: str | None = None, with_head: bool = True) -> list[Read]:
    """Every file a run reads: its input, its task file(s) and heads, its model. `kind`:
    the pipeline (``classify``, ``extract``, ``fit``; its default task); `task_file`: the
    task file when the caller has resolved it; `with_head`: the head the task names is
    read (not by a fit, which writes it)."""
    o, c = options.view_as(StepOptions), options.view_as(ClassifyOptions)
    reads = input_reads(options)
    if kind == "classify" and c.task_dir:
        tasks = task_reads(None, task_dir=c.task_dir)
        task_files = [f for pattern in TASK_PATTERNS for f in files_of(os.path.join(c.task_dir, pattern))]
    else:
        task_file = task_file or resolve_task(o.task or DEFAULT_TASKS.get(kind, DEFAULT_TASKS["classify"]))
        tasks, task_files = task_reads(task_file, with_head=with_head), [task_file]
    return reads + tasks + [r for m in _models(options, task_files) for r in model_reads(m)]


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
                    f"{read.flag} reads as {read.role} ({pattern}); write it elsewhere")
    refuse_package(outputs)  # the shipped tasks and heads every run may read (after the reads: their message names more)


def refuse_table_overlap(options: PipelineOptions) -> None:
    """Refuse an output table that is the input table."""
    o = options.view_as(StepOptions)
    for flag in ("output_table", "failed_output_table"):
        if o.input_table and getattr(o, flag) and getattr(o, flag) == o.input_table:
            raise OutputLocationError(f"--{flag}={o.input_table} is the --input_table this run reads; a run never "
                                      f"writes what it reads: choose another table")


def refuse_collisions(outputs: Sequence[Output]) -> None:
    """Refuse two outputs whose files would collide, and a single-file output that names a
    directory (`publish.Staging.check`)."""
    Staging(list(outputs)).check()


def refuse_inside(output: Output, directory_flag: str, directory: str) -> None:
    """Refuse `output` when it is, or lies inside, the output directory `directory`
    (compared as files: `paths.inside`)."""
    if inside(output.path, directory):
        raise OutputLocationError(f"{output.flag}={output.path} lies in {directory_flag}={directory}, which this run "
                                  f"writes as a whole; write it elsewhere")


def package_directory() -> str:
    """The installed ``beam_prefix`` package's folder (its shipped tasks, heads and data)."""
    import beam_prefix

    return canonical(os.path.dirname(beam_prefix.__file__))


def refuse_package(outputs: Iterable[Output]) -> None:
    """Refuse any output inside the ``beam_prefix`` package (compared as files: a checkout's
    ``pipelines/tasks`` links there): a run that replaced a shipped task or head would change
    what every later run of every user answers. A shipped head is refit into a new head and
    task file elsewhere (docs/heads.md).

    Raises:
        OutputLocationError: naming the flag and the package folder.
    """
    package = package_directory()
    for output in outputs:
        if is_local(output.path) and inside(output.path, package):
            raise OutputLocationError(
                f"{output.flag}={output.path} lies inside the installed beam_prefix package ({package}); no run "
                f"writes there (every later run would read it as shipped): write it elsewhere, e.g. a new head "
                f"and a task file that names it")


def hold_outputs(stack: contextlib.ExitStack, outputs: Iterable[Output]) -> None:
    """Take the lock of every output for as long as `stack` is open (`pipelines.output_lock`).

    Raises:
        OutputLockedError: another run is writing one of them.
    """
    stack.enter_context(locked((o.flag, o.path) for o in outputs))


REMOTE_TIMEOUT_S = 30.0  # how long a remote path may take to answer at launch


def remote_paths(options: PipelineOptions, outputs: Sequence[Output] = ()) -> list[tuple[str, str]]:
    """(flag, path) of every remote path a run names: its outputs (`outputs`, else the output
    flags as given), input, task, model, and Beam's --temp_location and --staging_location
    (a runner's own staging reads them first: Dataflow's took 2 minutes of retries offline)."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    o, g = options.view_as(StepOptions), options.view_as(GoogleCloudOptions)
    named = [(out.flag, out.path) for out in outputs] or [
        (f"--{flag}", getattr(o, flag)) for flag in ("output", "failed_output", "summary_output")]
    named += [(f"--{flag}", getattr(o, flag)) for flag in ("input", "task", "model")]
    named += [("--temp_location", g.temp_location), ("--staging_location", g.staging_location)]
    return [(flag, path) for flag, path in named if path and not is_local(path)]


def remote_heads(reads: Iterable[Read]) -> list[tuple[str, str]]:
    """(flag, path) of every remote head the run's task files name (`refuse_unreachable`
    probes them once the task files have been read)."""
    return [(r.flag, r.pattern) for r in reads if r.role == HEAD and not is_local(r.pattern)]


def refuse_unreachable(paths: Iterable[tuple[str, str]], timeout: float | None = None) -> None:
    """Refuse a remote path whose file system does not answer within `timeout` seconds
    (default `REMOTE_TIMEOUT_S`, or ``$BEAM_PREFIX_REMOTE_TIMEOUT_S``), or answers with an
    error (no such bucket, no credentials...). Each probe is one ``FileSystems.match`` of
    the path (a pattern, or a name that need not exist yet), run in a daemon thread, so a
    client that retries for minutes is left behind, not waited for.

    Raises:
        OutputLocationError: naming the flag, the path and what went wrong.
    """
    import threading

    from apache_beam.io.filesystems import FileSystems

    limit = timeout if timeout is not None else float(os.environ.get("BEAM_PREFIX_REMOTE_TIMEOUT_S", REMOTE_TIMEOUT_S))
    for flag, path in paths:
        answer: list = []

        def probe(path=path, answer=answer):
            try:
                FileSystems.match([path])
                answer.append(None)
            except Exception as e:  # noqa: BLE001 - any failure is the answer
                answer.append(e)

        worker = threading.Thread(target=probe, name="remote-probe", daemon=True)
        worker.start()
        worker.join(limit)
        if not answer:
            raise OutputLocationError(f"{flag}={path}: no answer from its file system within {limit:g} s (no "
                                      f"network, or a client retrying); check the path and your credentials")
        if answer[0] is not None:
            e = answer[0]
            raise OutputLocationError(f"{flag}={path}: cannot be reached ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:300] if str(e) else ''})")
