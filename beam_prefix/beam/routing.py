"""Per-row task routing: many prompts in one `ClassifyText` step.

    rows | ClassifyText(tasks="tasks/", task_column="tenant")      # tasks/<key>.yaml
    rows | ClassifyText(tasks={"acme": acme_spec, "globex": "globex.yaml"}, task_column="tenant")

Each row is classified with the task its `task_column` names, and every forward pass runs
over one prefix, the task's classifier looked up once per batch in the worker's bounded
`PrefixPool` (built on first use, evicted least recently used):

- batch pipelines: rows are keyed by task (and one of `TASK_SHARDS` shards, so one busy
  task still spreads over workers) and batched per key across the whole input by a
  stateful DoFn (`BatchPerTask`: out when full or at the end of the window). Beam's
  `GroupIntoBatches` is not used: its processing-time timer sends DirectRunner to the
  bundle-based runner, which lost such a step's outputs feeding two consumers (Beam 2.77);
- streaming: rows are batched per bundle (`BatchElements`, with ``max_batch_duration_secs``
  across bundles) and grouped by task inside each batch. Keyed stateful batching would
  hold rows behind the watermark, and on DirectRunner they then came out late and were
  dropped by the next grouping. A row whose key names no
task fails with reason ``unknown_task``.

Labelled rows carry ``label``, ``score``, the optional ``top_k``, ``truncated``, ``task``
(the key), ``task_version``, ``prompt_fingerprint`` and ``model``; the per-label
``prob_<label>`` columns only when every task has the same label set (else they would
differ row by row).
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any, Mapping

import apache_beam as beam
from apache_beam import coders
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, CombiningValueStateSpec, TimerSpec, on_timer

from beam_prefix.beam.classify_dofn import ClassifyConfig, PrefixCachedClassifyDoFn
from beam_prefix.beam.metrics import NAMESPACE
from beam_prefix.beam.step import FAILED_TAG, as_dict, failed_record, stamp, unstamp
from beam_prefix.tasks.task import TaskSpec

__all__ = ["load_tasks", "TaskRoutes", "KeyByTask", "BatchPerTask", "RoutedClassifyDoFn", "MAX_TASK_METRICS",
           "TASK_SHARDS"]

# per-task counters are named with the task key; past this many keys in a process the
# rest count under "other" (metric names are not free on every runner)
MAX_TASK_METRICS = 100
_KNOWN_KEYS_SHOWN = 5
TASK_SHARDS = 4


def load_tasks(tasks) -> dict[str, TaskSpec]:
    """``{key: TaskSpec}`` from a mapping of key -> `TaskSpec` or YAML path, or from a
    directory of ``*.yaml``/``*.yml`` task files keyed by file stem."""
    if isinstance(tasks, (str, os.PathLike)):
        directory = os.fspath(tasks)
        if not os.path.isdir(directory):
            raise ValueError(f"tasks={directory!r} is not a directory of task YAML files")
        files = sorted(f for f in os.listdir(directory) if f.endswith((".yaml", ".yml")))
        if not files:
            raise ValueError(f"tasks={directory!r} holds no *.yaml task file")
        tasks = {os.path.splitext(f)[0]: os.path.join(directory, f) for f in files}
    if not isinstance(tasks, Mapping) or not tasks:
        raise ValueError("tasks must be a non-empty mapping of key -> TaskSpec or task file, or a directory")
    out = {}
    for key, spec in tasks.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"task keys must be non-empty strings, got {key!r}")
        out[key] = spec if isinstance(spec, TaskSpec) else TaskSpec.from_yaml(spec)
    return out


@dataclasses.dataclass(frozen=True)
class TaskRoutes:
    """The per-task configs of a routed step, and the column that picks the task."""

    column: str
    configs: tuple[tuple[str, ClassifyConfig], ...]

    @classmethod
    def build(cls, tasks: Mapping[str, TaskSpec], column: str, base: dict[str, Any]) -> "TaskRoutes":
        """`base`: the `ClassifyConfig` arguments shared by every task."""
        if not column:
            raise ValueError("task_column must name the column that holds each row's task key")
        shared = len({spec.label_names for spec in tasks.values()}) == 1
        prob_columns = base.pop("prob_columns", None)
        if prob_columns and not shared:
            raise ValueError("prob_columns=True needs every task to have the same labels; use top_k instead")
        configs = tuple((key, ClassifyConfig(task=spec, route=key, prob_columns=prob_columns if shared else False,
                                             **base))
                        for key, spec in sorted(tasks.items()))
        return cls(column=column, configs=configs)

    def for_input(self, columns) -> "TaskRoutes":
        """Every task's config for input rows with `columns` (`StepConfig.for_input`)."""
        return dataclasses.replace(self, configs=tuple((k, c.for_input(columns)) for k, c in self.configs))

    @property
    def mapping(self) -> dict[str, ClassifyConfig]:
        return dict(self.configs)

    def describe_keys(self) -> str:
        keys = [k for k, _ in self.configs]
        return ", ".join(keys[:_KNOWN_KEYS_SHOWN]) + (f", ... ({len(keys)} tasks)" if len(keys) > _KNOWN_KEYS_SHOWN
                                                      else "")


class KeyByTask(beam.DoFn):
    """A (stamped) row -> ``(task key, row)``; a row with no known task -> ``failed``."""

    def __init__(self, routes: TaskRoutes):
        self.routes = routes
        self._known = None

    def setup(self):
        self._known = self.routes.mapping
        self._config = self.routes.configs[0][1]  # text and id columns: the same for every task

    def process(self, element):
        row, ts = unstamp(element)
        config = self._config
        try:
            fields = as_dict(row, config.text_column)
            key = fields.get(self.routes.column)
        except Exception as e:  # noqa: BLE001 - one row's problem fails that row
            fields, key, error = {"value": repr(row)[:200]}, None, f"{type(e).__name__}: {e}"
        else:
            error = None
        if error is None and isinstance(key, str) and key in self._known:
            yield (key, random.randrange(TASK_SHARDS)), element
            return
        if error is None:
            shown = repr(key)[:80]
            error = (f"column {self.routes.column!r} is missing" if self.routes.column not in fields else
                     f"no task {shown} (known: {self.routes.describe_keys()})")
        Metrics.counter(NAMESPACE, "rows_failed").inc()
        id_value = fields.get(config.id_column) if config.id_column else None
        yield beam.pvalue.TaggedOutput(FAILED_TAG, stamp(failed_record(
            fields, id_value=id_value, reason="unknown_task", error=error, stage="validate"), ts))


class BatchPerTask(beam.DoFn):
    """``((task, shard), row)`` -> ``((task, shard), [rows])``: up to `size` rows per batch,
    flushed when full and at the end of the window."""

    ROWS = BagStateSpec("rows", coders.FastPrimitivesCoder())
    COUNT = CombiningValueStateSpec("count", coders.VarIntCoder(), beam.combiners.CountCombineFn())
    WINDOW_END = TimerSpec("window_end", TimeDomain.WATERMARK)

    def __init__(self, size: int):
        self.size = size

    def process(self, element, window=beam.DoFn.WindowParam, rows=beam.DoFn.StateParam(ROWS),
                count=beam.DoFn.StateParam(COUNT), window_end=beam.DoFn.TimerParam(WINDOW_END)):
        key, row = element
        window_end.set(window.max_timestamp())
        rows.add(row)
        count.add(1)
        if count.read() >= self.size:
            yield from _flush(key, rows, count)

    @on_timer(WINDOW_END)
    def on_window_end(self, key=beam.DoFn.KeyParam, rows=beam.DoFn.StateParam(ROWS),
                      count=beam.DoFn.StateParam(COUNT)):
        yield from _flush(key, rows, count)


def _flush(key, rows, count):
    batch = list(rows.read())
    rows.clear()
    count.clear()
    if batch:
        yield key, batch


class RoutedClassifyDoFn(PrefixCachedClassifyDoFn):
    """Classify batches of routed rows, each task's rows with its pooled classifier."""

    def __init__(self, routes: TaskRoutes, *, step_name: str = "ClassifyText"):
        super().__init__(routes.configs[0][1], step_name=step_name)
        self.routes = routes

    def setup(self):
        self._attach("routed")  # each batch gets its task's classifier from the pool, on first use
        self._configs = self.routes.mapping

    def process(self, batch):
        """``((task, shard), [rows])`` from `BatchPerTask`, or a list of ``((task, shard), row)``
        from `BatchElements` (streaming), grouped here by task."""
        if isinstance(batch, tuple):
            groups = {batch[0][0]: list(batch[1])}
        else:
            groups = {}
            for (key, _), row in batch:
                groups.setdefault(key, []).append(row)
        for key, rows in groups.items():
            config = self._configs[key]
            used = self._holder.use(self.step_name, config)
            self._metrics.prefix_use(used, task=self._holder.task_metric_name(key, MAX_TASK_METRICS), rows=len(rows))
            yield from self._run_rows(used.engine.fork(), config, rows)
