"""`PrefixCachedClassifyDoFn`: classify batches of rows with a per-worker prefix cache.

`setup()` acquires the model through a process-wide `apache_beam.utils.shared.Shared`
handle (one load per worker process, shared by every thread and by every ClassifyText
step that uses the same model), gets the task's prefix cache (built once per process and
task, read-only), and forks its own classifier (under shared-prefix attention a fork
holds no state between calls; on the expanded cache it has its own working cache, which
no other thread touches). `process()` takes a list of rows (from
`BatchElements`), validates each row, classifies the good ones in one call, and emits
every row exactly once: to the main (`labeled`) output or to the `failed` output with a
reason and a stage.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import threading
import time
from typing import Any, Iterable, Mapping, NamedTuple

import apache_beam as beam
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils import shared

from beam_prefix.classifier import PrefixClassifier
from beam_prefix.errors import RowError
from beam_prefix.metrics import ClassifyMetrics, ProgressLog
from beam_prefix.prefix_pool import DEFAULT_MAX_PREFIX_CACHE_MB, PoolUse, PrefixPool
from beam_prefix.model import EMBEDDED, LoadedModel, load_model
from beam_prefix.task import TaskSpec

__all__ = ["PrefixCachedClassifyDoFn", "PrefixStepDoFn", "StepConfig", "ClassifyConfig", "FAILED_TAG",
           "LABELED_TAG", "prob_column", "TOP_K_COLUMN", "PROB_COLUMNS_MAX_LABELS", "METADATA_COLUMNS"]

_LOGGER = logging.getLogger(__name__)

LABELED_TAG = "labeled"
FAILED_TAG = "failed"
# the optional list<struct{label, score}> column of the `top_k` best labels
TOP_K_COLUMN = "top_k"
# columns that say how a row was produced, not what was found in it (see StepConfig.metadata_prefix)
METADATA_COLUMNS = ("truncated", "task", "task_version", "prompt_fingerprint", "model")
# per-label `prob_*` columns are on by default for tasks with at most this many labels
PROB_COLUMNS_MAX_LABELS = 32

# One handle per process: every DoFn that refers to it (any step, any thread) shares
# the models acquired through it, keyed by tag (model, dtype).
_MODEL_HANDLE = shared.Shared()


def prob_column(label: str) -> str:
    """Output column holding a label's probability (BigQuery/Parquet-safe name)."""
    return "prob_" + re.sub(r"[^0-9A-Za-z_]", "_", label)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What a prefix-cached step's DoFn needs, for any kind of task; validated at pipeline
    construction, not on the workers.

    Args:
        task: the task.
        model: ``embedded``, a directory, ``.gguf``, ``gs://`` directory or hub id.
        text_column: the column holding the text.
        id_column: optional id column, echoed in failed rows for easy lookup.
        dtype: ``float32`` (exact) or ``bfloat16``.
        threads: torch intra-op threads per worker process.
        batch_size: rows per forward pass (on sdpa models rows run packed, so rows of
            different lengths share a pass without padding).
        verify: run the cached-vs-full self-check when the prefix cache is built.
        keep_columns: the input columns copied to each output row (None, default: all
            of them). An input column that an output column would overwrite is refused:
            here when named in `keep_columns`, per row (reason ``column_clash``) otherwise.
        max_prefix_cache_mb: the bound of the worker process's prefix pool
            (`beam_prefix.prefix_pool`).
        metadata_prefix: a prefix for this step's metadata columns (`METADATA_COLUMNS`:
            ``truncated``, ``task``, ``task_version``, ``prompt_fingerprint``, ``model``).
            None (default): no prefix, unless the input rows already carry such columns
            (an earlier prefix-cached step's, e.g. ``ClassifyText`` then ``ExtractFields``):
            then `DEFAULT_PREFIX` of the step's kind (``classify_``, ``extract_``), so no
            input column is overwritten and each metadata column names its step.
    """

    DEFAULT_PREFIX = "step_"  # each kind of step has its own

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

    def __post_init__(self):
        if not self.text_column:
            raise ValueError("text_column must be a column name")
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
        worker process and task, then forked per DoFn instance."""
        raise NotImplementedError

    @property
    def model_tag(self) -> str:
        return f"{self.model}|{self.dtype}"

    @property
    def task_key(self) -> str:
        return json.dumps([type(self.task).__name__, dataclasses.asdict(self.task), self.batch_size],
                          sort_keys=True, default=str)


@dataclasses.dataclass(frozen=True)
class ClassifyConfig(StepConfig):
    """A classification step's settings (`StepConfig`'s, and these).

    Args:
        top_k: add a `top_k` column: the `top_k` most probable labels, best first, as
            ``[{"label": str, "score": float}, ...]`` (None or 0: no such column).
        prob_columns: one ``prob_<label>`` column per label; None (default): on for
            tasks of at most `PROB_COLUMNS_MAX_LABELS` labels.
        route: the task's key when rows are routed among several tasks (adds the
            ``task`` and ``task_version`` columns; see `beam_prefix.routing`).
    """

    DEFAULT_PREFIX = "classify_"

    task: TaskSpec = None  # type: ignore[assignment]  (required: checked below)
    top_k: int | None = None
    prob_columns: bool | None = None
    route: str | None = None

    def __post_init__(self):
        if not isinstance(self.task, TaskSpec):
            raise ValueError(f"ClassifyConfig needs a classification TaskSpec, got {type(self.task).__name__}")
        if self.prob_columns is None:
            object.__setattr__(self, "prob_columns", len(self.task.labels) <= PROB_COLUMNS_MAX_LABELS)
        columns = [prob_column(n) for n in self.task.label_names]
        if self.prob_columns and len(set(columns)) != len(columns):
            raise ValueError(f"labels {self.task.label_names} map to clashing column names {columns}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not self.top_k:
            object.__setattr__(self, "top_k", None)
        super().__post_init__()

    def added_columns(self) -> list[str]:
        """The columns classification adds to each labelled row, in order (unprefixed)."""
        probs = [prob_column(n) for n in self.task.label_names] if self.prob_columns else []
        top = [TOP_K_COLUMN] if self.top_k else []
        task = ["task"] if self.route is not None else []
        version = ["task_version"] if self.route is not None or self.task.version is not None else []
        return ["label", "score", *probs, *top, "truncated", *task, *version, "prompt_fingerprint", "model"]

    def build_engine(self, loaded: LoadedModel) -> PrefixClassifier:
        return PrefixClassifier(task=self.task, loaded=loaded, batch_size=self.batch_size, verify=self.verify)


class _ModelHolder:
    """The shared per-process object: one model, and one base classifier per task."""

    loads = 0  # model loads in this process (tests count them)
    last: "_ModelHolder | None" = None

    def __init__(self, config: StepConfig, loaded: LoadedModel | None = None):
        type(self).last = self
        self.prefix_builds = 0
        self.forks = 0
        if loaded is None:  # benchmarks hand in the model they already hold
            type(self).loads += 1
            loaded = load_model(config.model, dtype=config.dtype, threads=config.threads)
        self.loaded = loaded
        self._lock = threading.Lock()
        self.pool = PrefixPool(int(config.max_prefix_cache_mb * 2**20))
        self._task_names: set[str] = set()
        self._progress: dict[str, ProgressLog] = {}
        # start-up costs not yet reported as metrics (setup() runs outside a bundle, where
        # Beam does not record metrics, so the next process() reports them)
        self._startup: list[dict[str, float]] = []
        self._model_load_s = loaded.load_s

    def classifier_for(self, config: StepConfig):
        """A fork of the task's engine (its prefix built once per process, pooled)."""
        return self.use(config).classifier.fork()

    def use(self, config: StepConfig) -> PoolUse:
        """The pool's entry for the task of `config`, built (and self-checked) if absent."""
        def build():
            base = config.build_engine(self.loaded)
            with self._lock:
                self.prefix_builds += 1
                self._startup.append({"model_load_s": self._model_load_s, **base.startup})
                self._model_load_s = 0.0  # one load per process, however many tasks
            return base

        used = self.pool.get(config.task_key, build)
        with self._lock:
            self.forks += 1
        return used

    def task_metric_name(self, key: str, limit: int) -> str:
        """`key`, or ``other`` once `limit` other keys have their own metrics in this process."""
        with self._lock:
            if key in self._task_names or len(self._task_names) < limit:
                self._task_names.add(key)
                return key
        return "other"

    def take_startup(self) -> list[dict[str, float]]:
        """Start-up reports not yet taken (each is taken once, by one DoFn)."""
        with self._lock:
            taken, self._startup = self._startup, []
        return taken

    def progress_for(self, name: str) -> ProgressLog:
        """One progress line per step and worker process, fed by all its threads."""
        with self._lock:
            return self._progress.setdefault(name, ProgressLog(name))


class PrefixStepDoFn(beam.DoFn):
    """The row discipline every prefix-cached step shares: a batch's rows are validated one
    by one, run in one engine call (retried row by row if the call fails), and each row is
    emitted exactly once, to the main output or to `failed` with a reason and a stage.

    Subclasses say how to run the engine (`_call`) and what a result becomes (`_emit`)."""

    def __init__(self, config: StepConfig, *, step_name: str):
        self.config = config
        self.step_name = step_name
        self._engine = None

    def setup(self):
        self._attach(self.config.task.name)
        self._engine = self._holder.classifier_for(self.config)

    def _attach(self, name: str) -> None:
        """The process's shared model holder, this instance's metrics and progress line."""
        self._holder = _MODEL_HANDLE.acquire(lambda: _ModelHolder(self.config), tag=self.config.model_tag)
        self._metrics = ClassifyMetrics()
        self._progress = self._holder.progress_for(f"{self.step_name}[{name}]")

    def process(self, batch: Iterable[Any]):
        """Elements are rows, or `Stamped` rows (whose outputs then carry their timestamp)."""
        yield from self._run_rows(self._engine, self.config, batch)

    def _call(self, engine, encoded: list) -> list:
        raise NotImplementedError

    def _emit(self, engine, config: StepConfig, row: dict, result, timestamp) -> Iterable[Any]:
        """The output of one row's result; returns nothing for a failed row (`_failed`)."""
        raise NotImplementedError

    def _run_rows(self, engine, config: StepConfig, batch: Iterable[Any]):
        """Validate, run (one call) and emit every row of `batch` once, with `engine` (a
        fork of the task's engine) and the task's `config`."""
        for report in self._holder.take_startup():
            self._metrics.report_startup(report)
        good, encoded = [], []  # good: (row, its timestamp or None, the config for its columns)
        for element in batch:
            element, ts = _unstamp(element)
            row = _as_dict(element, config.text_column)
            try:
                row_config = _row_config(config, row)
                encoded.append(engine.encode(_text_of(config, row)))
                good.append((row, ts, row_config))
            except RowError as e:
                yield self._failed(config, row, e.reason, str(e), "validate", ts)
            except Exception as e:  # whatever else one row raises fails that row, not the bundle
                yield self._failed(config, row, "invalid_row", f"{type(e).__name__}: {e}", "validate", ts)
        if not good:
            return
        start = time.perf_counter()
        try:
            results = self._call(engine, encoded)
        except Exception as e:  # one bad batch: retry row by row, fail only what still fails
            _LOGGER.warning("%s: batch of %d rows failed (%s); retrying row by row",
                            self.step_name, len(good), e)
            self._metrics.model_retries.inc()
            results = []
            for enc in encoded:
                try:
                    results.append(self._call(engine, [enc])[0])
                except Exception as row_error:
                    results.append(row_error)
        elapsed = time.perf_counter() - start
        self._metrics.batch_size.update(len(good))
        self._metrics.batch_latency.update(int(elapsed * 1e6))
        for (row, ts, row_config), result in zip(good, results):
            if isinstance(result, Exception):
                yield self._failed(config, row, "model_error", f"{type(result).__name__}: {result}", "model", ts)
                continue
            self._metrics.prefix_tokens_reused.inc(engine.prefix_length)
            if result.truncated:
                self._metrics.rows_truncated.inc()
            yield from self._emit(engine, row_config, row, result, ts)
        self._progress.add(sum(not isinstance(r, Exception) for r in results), elapsed)

    def teardown(self):
        self._engine = None
        self._holder = None

    def _failed(self, config: StepConfig, row: dict, reason: str, error: str, stage: str, timestamp=None):
        self._metrics.rows_failed.inc()
        record = failed_record(row, id_value=row.get(config.id_column) if config.id_column else None,
                               reason=reason, error=error, stage=stage)
        return beam.pvalue.TaggedOutput(FAILED_TAG, _stamp(record, timestamp))


class PrefixCachedClassifyDoFn(PrefixStepDoFn):
    """Classify a batch (list) of dict rows; main output `labeled`, tagged output `failed`.

    Labelled rows are the input columns plus ``label``, ``score``, one ``prob_<label>``
    column per label (`ClassifyConfig.prob_columns`), ``top_k`` (with
    `ClassifyConfig.top_k`), ``truncated``, ``prompt_fingerprint`` and ``model``. Failed rows are
    ``{"row": <input row>, "id": ..., "reason": ..., "error": ..., "stage": ...}``.
    """

    def __init__(self, config: ClassifyConfig, *, step_name: str = "ClassifyText"):
        super().__init__(config, step_name=step_name)

    def _call(self, clf: PrefixClassifier, encoded: list) -> list:
        return clf.classify_encoded(encoded)

    def _emit(self, clf: PrefixClassifier, config: ClassifyConfig, row: dict, pred, timestamp):
        self._metrics.suffix_tokens_computed.inc(pred.suffix_tokens)
        self._metrics.label_tokens_computed.inc(pred.label_tokens)
        self._metrics.rows_classified.inc()
        yield _stamp(_labeled(clf, config, row, pred), timestamp)


def failed_record(row, *, id_value=None, reason: str, error: str, stage: str) -> dict:
    """A row of the ``failed`` output (also the shape of the pipelines' read failures)."""
    return {"row": row, "id": id_value, "reason": reason, "error": error, "stage": stage}


def _row_config(config: StepConfig, row: Mapping[str, Any]) -> StepConfig:
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


def _text_of(config: ClassifyConfig, row: Mapping[str, Any]):
    if config.text_column not in row:
        columns = sorted(map(str, row))  # keys may be None (ragged CSV) or ints
        raise RowError(f"row has no column {config.text_column!r} (columns: {columns[:20]})",
                       reason="missing_column")
    return row[config.text_column]


def _labeled(clf: PrefixClassifier, config: ClassifyConfig, row: dict, pred) -> dict:
    keep = config.keep_columns
    out = dict(row) if keep is None else {c: row.get(c) for c in keep}
    out["label"] = pred.label
    out["score"] = pred.score
    if config.prob_columns:
        for name in config.task.label_names:
            out[prob_column(name)] = pred.scores[name]
    if config.top_k:
        out[TOP_K_COLUMN] = [{"label": label, "score": score} for label, score in pred.top(config.top_k)]
    out[config.column("truncated")] = pred.truncated
    if config.route is not None:
        out[config.column("task")] = config.route
    if config.route is not None or config.task.version is not None:
        out[config.column("task_version")] = config.task.version
    out[config.column("prompt_fingerprint")] = clf.fingerprint
    out[config.column("model")] = clf.model_id
    return out


class Stamped(NamedTuple):
    """A row and its own event timestamp (`ClassifyText` batches these, so each output
    row is stamped with its input row's timestamp, not the batch's)."""

    row: Any
    timestamp: Any


def _unstamp(element) -> tuple[Any, Any]:
    return (element.row, element.timestamp) if isinstance(element, Stamped) else (element, None)


def _stamp(value, timestamp):
    return value if timestamp is None else TimestampedValue(value, timestamp)


def _as_dict(row: Any, text_column: str) -> dict:
    if isinstance(row, Mapping):
        return dict(row)
    if hasattr(row, "_asdict"):  # NamedTuples
        return dict(row._asdict())
    if isinstance(row, beam.Row):
        return dict(row.as_dict())
    if isinstance(row, (str, bytes)):  # a bare text is a row with only the text column
        return {text_column: row}
    return {"value": row}  # fails validation: no text column
