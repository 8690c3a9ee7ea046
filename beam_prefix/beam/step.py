"""What every prefix-cached Beam step shares, whatever its engine computes.

- `StepConfig`: a step's settings, validated at pipeline construction (each kind adds
  its own: `dofn.ClassifyConfig`, `extract_transform.ExtractConfig`), and which output
  columns it adds, with the metadata prefix that lets steps chain;
- rows: dict views of dict, `beam.Row` and NamedTuple rows (`as_dict`), a row's text
  (`text_of`), its own event timestamp through batching (`Stamped`, `stamp`, `unstamp`),
  the failed output's record (`failed_record`);
- the graph: Beam batching arguments (`batching_args`), rows -> stamped -> batched -> the
  step's DoFn (`batched_step`), schema'd outputs for schema'd input (`as_rows`), and the
  result (`StepResult`: a dict of named outputs).

The DoFn that runs on workers is `worker.PrefixStepDoFn`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, ClassVar, Mapping, NamedTuple

import apache_beam as beam
from apache_beam.transforms.window import TimestampedValue

from beam_prefix.errors import RowError
from beam_prefix.model.loading import EMBEDDED, LoadedModel, check_device
from beam_prefix.beam.prefix_pool import DEFAULT_MAX_PREFIX_CACHE_MB
from beam_prefix.beam.schemas import FAILED_TYPE, ToRow, failed_row, input_fields

__all__ = ["StepConfig", "StepResult", "Stamped", "FAILED_TAG", "METADATA_COLUMNS", "stamp", "unstamp",
           "failed_record", "as_dict", "text_of", "row_config", "batching_args", "batched_step", "as_rows",
           "refuse_clashing_fields", "refuse_runner", "with_timestamp", "PrefixStep"]

FAILED_TAG = "failed"
# columns that say how a row was produced, not what was found in it (see StepConfig.metadata_prefix)
METADATA_COLUMNS = ("truncated", "task", "task_version", "prompt_fingerprint", "model")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What a prefix-cached step's DoFn needs, for any kind of task; validated at pipeline
    construction, not on the workers.

    Args:
        task: the task.
        model: ``embedded``, a directory, ``.gguf``, ``gs://`` directory or hub id.
        text_column: the column holding the text.
        id_column: optional id column, echoed in failed rows for easy lookup.
        dtype: ``float32`` (exact), ``bfloat16`` or (on GPUs) ``float16`` (the linear
            layers in half precision, the rest float32: `beam_prefix.model.half_precision`).
        threads: torch intra-op threads while this step runs (torch's count is per
            process: steps with different counts in one process set it in turn); None:
            all cores or one thread, whichever its batches run faster with
            (`beam_prefix.beam.thread_choice`).
        batch_size: rows per forward pass (on sdpa models rows run packed, so rows of
            different lengths share a pass without padding).
        verify: run the cached-vs-full self-check when the prefix cache is built.
        keep_columns: the input columns copied to each output row (None, default: all
            of them). An input column that an output column would overwrite is refused:
            here when named in `keep_columns`, per row (reason ``column_clash``) otherwise.
        max_prefix_cache_mb: the bound of this step's prefix pool in each worker
            process (`beam_prefix.beam.prefix_pool`).
        metadata_prefix: a prefix for this step's metadata columns (`METADATA_COLUMNS`:
            ``truncated``, ``task``, ``task_version``, ``prompt_fingerprint``, ``model``).
            None (default): no prefix, unless the input rows already carry such columns
            (an earlier prefix-cached step's, e.g. ``ClassifyText`` then ``ExtractFields``):
            then `DEFAULT_PREFIX` of the step's kind (``classify_``, ``extract_``), so no
            input column is overwritten and each metadata column names its step.
        device: ``cpu`` (default), ``cuda``, ``cuda:N`` or ``auto`` (a GPU where there is
            one): where each worker process places the model.
    """

    DEFAULT_PREFIX: ClassVar[str] = "step_"  # each kind of step has its own
    engine: ClassVar[type]  # the kind's `prefix_engine.PrefixEngine` subclass

    task: Any
    model: str = EMBEDDED
    text_column: str = "text"
    id_column: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    batch_size: int = 16
    verify: bool = True
    keep_columns: tuple[str, ...] | None = None
    max_prefix_cache_mb: float = DEFAULT_MAX_PREFIX_CACHE_MB
    metadata_prefix: str | None = None
    device: str = "cpu"

    def __post_init__(self):
        if not self.text_column:
            raise ValueError("text_column must be a column name")
        check_device(self.device, self.dtype)
        if self.metadata_prefix is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", self.metadata_prefix):
            raise ValueError(f"metadata_prefix must be letters, digits or '_' (not starting with a digit), "
                             f"got {self.metadata_prefix!r}")
        if self.keep_columns is not None:
            if isinstance(self.keep_columns, str) or not all(isinstance(c, str) for c in self.keep_columns):
                raise ValueError(f"keep_columns must be a sequence of column names, got {self.keep_columns!r}")
            object.__setattr__(self, "keep_columns", tuple(dict.fromkeys(self.keep_columns)))
            clash = self.clashing(self.keep_columns)
            if clash:
                raise ValueError(f"keep_columns {clash} would be overwritten by output columns of the same "
                                 f"name; leave them out (or rename them before this step)")

    def clashing(self, columns) -> list[str]:
        """The names among `columns` that an output column would overwrite."""
        added = set(self.output_columns)
        return [c for c in columns if c in added]

    @property
    def output_columns(self) -> list[str]:
        """The columns this step adds to each row, in order (metadata ones prefixed)."""
        return [self.column(name) for name in self.added_columns()]

    def added_columns(self) -> list[str]:
        """The columns this step adds, unprefixed."""
        raise NotImplementedError

    def metadata(self, engine, truncated: bool) -> dict:
        """The metadata columns' values for a row the step's engine produced (prefixed)."""
        out = {self.column("truncated"): truncated}
        if self.task.version is not None:
            out[self.column("task_version")] = self.task.version
        out[self.column("prompt_fingerprint")] = engine.fingerprint
        out[self.column("model")] = engine.model_id
        return out

    def metadata_fields(self) -> list[tuple[str, type]]:
        """The metadata columns' (name, type) in a schema'd output (prefixed)."""
        version = [(self.column("task_version"), str)] if self.task.version is not None else []
        return [(self.column("truncated"), bool), *version, (self.column("prompt_fingerprint"), str),
                (self.column("model"), str)]

    def column(self, name: str) -> str:
        """The output name of added column `name` (a metadata column gets the prefix)."""
        return (self.metadata_prefix or "") + name if name in METADATA_COLUMNS else name

    def for_input(self, columns) -> "StepConfig":
        """This config for input rows with `columns`: with `DEFAULT_PREFIX` when they already
        hold metadata columns this step would write, no prefix was given and every input
        column is copied."""
        if self.metadata_prefix is not None or self.keep_columns is not None:
            return self
        if not any(name in columns for name in METADATA_COLUMNS):
            return self
        return self._prefixed

    @functools.cached_property
    def _prefixed(self) -> "StepConfig":  # built once per config (per row otherwise)
        return dataclasses.replace(self, metadata_prefix=self.DEFAULT_PREFIX)

    def build_engine(self, loaded: LoadedModel):
        """The task's engine over `loaded` (prefix built and self-checked): built once per
        worker process, step and task, then forked per DoFn instance; `engine_options` are
        its keyword arguments beyond these (and part of the pool's `task_key`)."""
        return self.engine(task=self.task, loaded=loaded, batch_size=self.batch_size, verify=self.verify,
                           **self.engine_options)

    def check_fits(self) -> None:
        """At launch: refuse a task whose prompt cannot fit the model, or whose head was fit
        for another prompt, model or dtype (its configuration and tokenizer only;
        `PrefixEngine.check_fits`)."""
        self.engine.check_fits(self.task, self.model, dtype=self.dtype)

    @property
    def model_tag(self) -> str:
        """One loaded model per worker process for each (model, dtype, device)."""
        return f"{self.model}|{self.dtype}|{self.device}"

    @property
    def engine_options(self) -> dict:
        """Settings beyond the task and batch size that shape the engine a step builds: the
        engine's keyword arguments (`build_engine`)."""
        return {}

    @property
    def task_key(self) -> str:
        """What a worker's pooled engine is keyed by: two steps share one only if all of it matches."""
        return json.dumps([type(self.task).__name__, dataclasses.asdict(self.task), self.batch_size,
                           self.engine_options], sort_keys=True, default=str)


class Stamped(NamedTuple):
    """A row and its own event timestamp (a step batches these, so each output row is
    stamped with its input row's timestamp, not the batch's)."""

    row: Any
    timestamp: Any


def unstamp(element) -> tuple[Any, Any]:
    """(row, its timestamp or None) of a `Stamped` row or a plain one."""
    return (element.row, element.timestamp) if isinstance(element, Stamped) else (element, None)


def stamp(value, timestamp):
    """An output element carrying its input row's timestamp (where it had one)."""
    return value if timestamp is None else TimestampedValue(value, timestamp)


def failed_record(row, *, id_value=None, reason: str, error: str, stage: str) -> dict:
    """A row of the ``failed`` output (also the shape of the pipelines' read failures)."""
    return {"row": row, "id": id_value, "reason": reason, "error": error, "stage": stage}


def as_dict(row: Any, text_column: str) -> dict:
    """A row as a dict of its fields (nested values as they are); a bare text as
    ``{text_column: text}``; anything else as ``{"value": ...}`` (which fails validation)."""
    if isinstance(row, Mapping):
        return dict(row)
    if hasattr(row, "_asdict"):  # NamedTuples
        return dict(row._asdict())
    if isinstance(row, beam.Row):
        return dict(row.as_dict())
    if isinstance(row, (str, bytes)):  # a bare text is a row with only the text column
        return {text_column: row}
    return {"value": row}  # fails validation: no text column


def refuse_runner(pcoll, step: str) -> None:
    """Refuse a runner that loses rows of a multi-output step: Beam's DaskRunner (2.77)
    hands every consumer of a tagged output all of the step's outputs, so labelled rows
    land in ``failed`` too and the run still ends done."""
    runner = getattr(getattr(pcoll, "pipeline", None), "runner", None)
    if runner is not None and "dask" in type(runner).__name__.lower():
        raise ValueError(f"{step}: Beam's {type(runner).__name__} hands every consumer of a multi-output step all "
                         f"of its outputs, so rows would land in the wrong output and the run would end done; use "
                         f"DirectRunner, a portable runner (Flink, Spark) or Dataflow")


def text_of(config: StepConfig, row: Mapping[str, Any]):
    """The row's text column (`RowError` ``missing_column`` without one)."""
    if config.text_column not in row:
        columns = sorted(map(str, row))  # keys may be None (ragged CSV) or ints
        raise RowError(f"row has no column {config.text_column!r} (columns: {columns[:20]})",
                       reason="missing_column")
    return row[config.text_column]


def row_config(config: StepConfig, row: Mapping[str, Any]) -> StepConfig:
    """The config for one dict row's columns (`StepConfig.for_input`); a row whose copied
    columns an output column would still overwrite fails with ``column_clash``."""
    if config.keep_columns is not None:
        return config
    config = config.for_input(row)  # the whole row is copied: nothing may be overwritten
    clash = config.clashing(row)
    if clash:
        raise RowError(f"input columns {clash[:10]} would be overwritten by the output columns of "
                       f"the same name; rename them, or pass keep_columns without them",
                       reason="column_clash")
    return config


def batching_args(batch_size: int, min_batch_size: int | None, max_batch_size: int | None,
                  max_batch_duration_secs: float | None, *, start_full: bool = False) -> dict:
    """`beam.BatchElements` settings for a step running `batch_size` rows per forward pass.

    `start_full`: Beam batches start at `batch_size` rows (default min: 8). Decoding
    (extraction) wants full batches from the first: a decode step of 64 rows costs little
    more than one of 8, and BatchElements would otherwise grow from 8 over many batches."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1 (rows per forward pass), got {batch_size!r}")
    if max_batch_size is None:
        # several forward batches per Beam batch: fewer per-batch costs, and on the
        # expanded-cache path (non-sdpa models, which pad) a length-sorted Beam batch
        # groups similar lengths into each forward pass
        max_batch_size = max(64, 4 * batch_size, min_batch_size or 1)
    if min_batch_size is None:
        min_batch_size = min(batch_size if start_full else 8, max_batch_size)
    if not 1 <= min_batch_size <= max_batch_size:
        raise ValueError(f"need 1 <= min_batch_size <= max_batch_size, got {min_batch_size}, {max_batch_size}")
    return dict(min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                max_batch_duration_secs=max_batch_duration_secs)


def batched_step(rows, dofn, *, main: str, label: str, step: str, min_batch_size: int, max_batch_size: int,
                 max_batch_duration_secs: float | None = None):
    """Rows -> (main output, failed): each row stamped with its own timestamp, batched with
    `beam.BatchElements`, run by `dofn` (a `PrefixStepDoFn`)."""
    refuse_clashing_fields(dofn.config, input_fields(rows.element_type), label)
    batching = dict(min_batch_size=min_batch_size, max_batch_size=max_batch_size)
    if max_batch_duration_secs is not None:
        batching["max_batch_duration_secs"] = max_batch_duration_secs
    outputs = (rows
               | "KeepTimestamps" >> beam.Map(with_timestamp)
               | "Batch" >> beam.BatchElements(**batching)
               | step >> beam.ParDo(dofn).with_outputs(FAILED_TAG, main=main))
    return outputs[main], outputs[FAILED_TAG]


def as_rows(main, failed, row_type, name: str, *, top_k: bool = False):
    """A step's dict outputs as schema'd rows: `main` of `row_type`, `failed` of `FAILED_TYPE`
    (`top_k`: the step wrote its own ``top_k`` column, see `schemas.ToRow`)."""
    main = main | name >> beam.Map(ToRow(row_type, top_k=top_k)).with_output_types(row_type)
    failed = failed | "FailedRows" >> beam.Map(failed_row).with_output_types(FAILED_TYPE)
    return main, failed


def with_timestamp(row, ts=beam.DoFn.TimestampParam) -> Stamped:
    """`row` with its own event timestamp (a Beam batch carries its window's end)."""
    return Stamped(row, ts)


def refuse_missing_text(config, fields, label: str) -> None:
    """Refuse, where the pipeline is built, a schema'd input without the text column: every
    row would otherwise fail as ``missing_column``."""
    names = [name for name, _ in fields or ()]
    if fields and config.text_column not in names:
        raise ValueError(f"{label}: the input's schema has no text column {config.text_column!r} (its fields: "
                         f"{names[:20]}); pass text_column= naming the one that holds the text")


def refuse_clashing_fields(config, fields, label: str) -> None:
    """Refuse, at construction, schema'd input fields an output column would overwrite."""
    if fields and config.keep_columns is None:
        clash = config.clashing([name for name, _ in fields])
        if clash:
            raise ValueError(f"{label}: input fields {clash} would be overwritten by output columns of "
                             f"the same name; rename them, or pass keep_columns without them")


class PrefixStep(beam.PTransform):
    """A Beam step over one prefix-cached engine: rows -> its main output and ``failed``.

    A kind sets `main` (the main output's name), `dofn` (its `worker.PrefixStepDoFn`),
    `step` and `rows_step` (step names) and `row_type` (its schema'd output for input
    fields), and builds its `StepConfig` and batching arguments in its constructor."""

    main: ClassVar[str]
    dofn: ClassVar[type]
    step: ClassVar[str]
    rows_step: ClassVar[str]

    def __init__(self, config: StepConfig, batching: dict, label: str | None = None):
        super().__init__(label)
        self._config, self._batching = config, batching

    @property
    def config(self):
        return self._config

    def row_type(self, config, fields):
        raise NotImplementedError

    def expand(self, rows):
        refuse_runner(rows, self.label)
        fields = input_fields(rows.element_type)
        refuse_missing_text(self._config, fields, self.label)
        # an earlier step's metadata columns (schema'd input: known now) get this step's prefix beside them
        config = self._config.for_input([name for name, _ in fields or ()])
        main, failed = batched_step(rows, self.dofn(config, step_name=self.label), main=self.main, label=self.label,
                                    step=self.step, **self._batching)
        records = failed
        if fields:  # schema'd input: schema'd outputs
            main, failed = as_rows(main, failed, self.row_type(config, fields), self.rows_step)
        return self.result(**{self.main: main}, failed=failed, _records=records)

    result: ClassVar[type]  # set below: `StepResult`


class StepResult(dict):
    """A step's outputs, e.g. `ClassifyText`'s ``result.labeled`` / ``result["labeled"]``
    and ``result.failed`` / ``result["failed"]`` (a dict, as Beam YAML expects).

    `failed_records` (an attribute, not an output) holds the failed rows before any
    schema: ``{"row": <the input row's fields, nested values as they came>, ...}``; Beam
    YAML's error output is built from it, so nested fields pass through unchanged."""

    def __init__(self, *, _records=None, **outputs):
        super().__init__(**outputs)
        self.failed_records = _records

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


PrefixStep.result = StepResult
