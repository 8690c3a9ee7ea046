"""`ClassifyText`: the composite transform to drop into an existing Beam pipeline.

    result = rows | ClassifyText(task="support_tickets", text_column="text")
    result.labeled  # input columns + label, score, prob_<label>..., [top_k], truncated, prompt_fingerprint, model
    result.failed   # {"row", "id", "reason", "error", "stage"}

Rows are dicts (or `beam.Row`s, or bare strings); they are batched with
`beam.BatchElements` (bounds settable), and each batch is classified by
`PrefixCachedClassifyDoFn`, `batch_size` rows per forward pass. A Beam batch spans
several forward passes, so per-batch costs are paid once per several passes.
"""

from __future__ import annotations

import os
import typing

import apache_beam as beam
from apache_beam.options.pipeline_options import StandardOptions

from beam_prefix.beam.classify_dofn import LABELED_TAG, ClassifyConfig, PrefixCachedClassifyDoFn
from beam_prefix.model.loading import EMBEDDED
from beam_prefix.beam.prefix_pool import DEFAULT_MAX_PREFIX_CACHE_MB
from beam_prefix.beam.routing import BatchPerTask, KeyByTask, RoutedClassifyDoFn, TaskRoutes, load_tasks
from beam_prefix.beam.schemas import input_fields, labeled_type
from beam_prefix.beam.step import (FAILED_TAG, StepResult, as_rows, batched_step, batching_args, refuse_clashing_fields,
                                   refuse_missing_text,
                                   refuse_runner, with_timestamp)
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.tasks.trained_head import dtype_for

__all__ = ["ClassifyText", "ClassifyResult", "batched_step", "batching_args", "as_rows"]


class ClassifyText(beam.PTransform):
    """Classify text rows with a prefix-cached causal LM.

    Args:
        task: a shipped task's name (``support_tickets``, ``support_tickets_head``,
            ``banking77_head``, ...: `shipped_tasks()`), a task YAML file's path or a
            `TaskSpec` (read at construction, so workers do not need the file).
        tasks: instead of `task`, route each row to the task its `task_column` names: a
            mapping of key -> task (as `task`), or a directory of task files keyed by
            stem (`beam_prefix.beam.routing`).
        task_column: with `tasks`, the column holding each row's task key.
        max_prefix_cache_mb: the bound of each worker process's pool of prefix caches
            (default 512; least recently used tasks are dropped and rebuilt on demand).
        model: ``embedded`` (default: the task's model, else embedded), a directory, a
            ``.gguf`` file, a ``gs://`` directory or a hub id.
        text_column: column holding the text.
        id_column: optional id column echoed in failed rows.
        dtype: ``float32`` (exact), ``bfloat16`` or (on GPUs) ``float16`` (the linear
            layers in half precision, the rest float32). Default: the precision the task's
            head was fit in, else float32; a head answers only in its own, so another is
            refused here (`trained_head.dtype_for`).
        threads: torch intra-op threads per worker process (default None: all cores or
            one thread, whichever the step's batches run faster with; `beam.thread_choice`).
        min_batch_size: the smallest Beam batch (`beam.BatchElements`; default
            min(8, max_batch_size)).
        max_batch_size: the largest Beam batch (default max(64, 4 x batch_size)).
        max_batch_duration_secs: buffer rows across bundles for at most this long to
            fill a batch (`beam.BatchElements`' stateful batching, for streaming, where
            bundles are small). Rows buffered this way are released by a timer; where
            the runner does not hold the watermark for them (Python's DirectRunner
            releases them only at the window's end), windowing after classification can
            find them late. A routed step in a batch pipeline batches per task instead.
        batch_size: rows per forward pass inside a Beam batch (a whole number >= 1).
        max_text_tokens: overrides the task's token budget for one row's text.
        overflow: overrides the task's ``truncate`` or ``reject``.
        calibration: overrides the task's calibration (true, false or a list of
            content-free texts).
        label_search: overrides the task's ``auto``, ``pruned`` or ``exhaustive``.
        label_tolerance: overrides the task's pruned-search tolerance.
        verify: run the cached-vs-full self-check on each worker at start-up.
        top_k: add a ``top_k`` column, the `top_k` best labels as a list of
            ``{"label", "score"}`` records, best first (a whole number >= 1; default
            None: no such column).
        prob_columns: one ``prob_<label>`` column per label (default: for tasks of at
            most 32 labels).
        keep_columns: input columns copied to each labelled row (default: all). Input
            columns that output columns would overwrite (``label``, ``score``, ...) are
            refused: a `ValueError` here when named in `keep_columns` or declared by the
            input's schema, else a failed row with reason ``column_clash``.
        metadata_prefix: a prefix for the metadata columns (``truncated``, ``task``,
            ``task_version``, ``prompt_fingerprint``, ``model``). Default: none, unless the
            input already has such columns (an earlier step's): then ``classify_``.
        device: ``cpu`` (default), ``cuda``, ``cuda:N`` or ``auto``: where each worker
            process places the model (docs/scale.md, "GPU workers").
        output_features: add a ``features`` column (a list of floats): each row's features
            from the same pass (`beam_prefix.beam.embed_transform`; what a trained head reads).
        suffix_pass: ``packed`` (default), ``buckets`` or ``graphs``: on a GPU, ``graphs``
            replays each batch's pass as a CUDA graph (docs/scale.md, "GPU workers"; needs
            ``device`` cuda, cuda:N or auto, and a worker without a GPU runs packed).
        label: the step's Beam label.

    Returns:
        a `ClassifyResult`: ``labeled`` and ``failed`` PCollections (as attributes or
        keys). Each output row keeps its input row's timestamp and window. With a
        schema'd input (`beam.Row`, NamedTuple) both are schema'd (see
        `beam_prefix.beam.schemas`); dict rows give dicts.
    """

    def __init__(self, task: TaskSpec | str | os.PathLike | None = None, *, model: str | None = None,
                 text_column: str = "text", id_column: str | None = None, dtype: str | None = None,
                 threads: int | None = None, min_batch_size: int | None = None,
                 max_batch_size: int | None = None,
                 batch_size: int = 16, max_text_tokens: int | None = None, overflow: str | None = None,
                 calibration=None, verify: bool = True, label_search: str | None = None,
                 label_tolerance: float | None = None, top_k: int | None = None,
                 prob_columns: bool | None = None, keep_columns=None, max_batch_duration_secs: float | None = None,
                 tasks=None, task_column: str | None = None, max_prefix_cache_mb: float | None = None,
                 metadata_prefix: str | None = None, device: str = "cpu", output_features: bool = False,
                 suffix_pass: str = "packed", label: str | None = None):
        super().__init__(label)
        if (task is None) == (tasks is None):
            raise ValueError("give either task (one prompt) or tasks with task_column (a prompt per row)")
        if tasks is not None and not task_column:
            raise ValueError("tasks needs task_column: the column holding each row's task key")
        specs = load_tasks(tasks) if tasks is not None else {
            "": task if isinstance(task, TaskSpec) else TaskSpec.from_yaml(task)}
        changes = {k: v for k, v in (("max_text_tokens", max_text_tokens), ("overflow", overflow),
                                     ("calibration", calibration), ("label_search", label_search),
                                     ("label_tolerance", label_tolerance)) if v is not None}
        if changes:
            specs = {key: spec.replace(**changes) for key, spec in specs.items()}
        task = next(iter(specs.values()))
        if model is None:
            models = {spec.model or EMBEDDED for spec in specs.values()}
            if len(models) > 1:
                raise ValueError(f"the tasks name different models {sorted(models)}; one step runs one model: "
                                 f"pass model=")
            model = models.pop()
        dtype = dtype_for((spec.head for spec in specs.values()), dtype)  # a head's own, else float32
        self._batching = batching_args(batch_size, min_batch_size, max_batch_size, max_batch_duration_secs)
        base = dict(model=model, text_column=text_column, id_column=id_column, dtype=dtype, threads=threads,
                    batch_size=batch_size, verify=verify, top_k=top_k, prob_columns=prob_columns,
                    output_features=output_features, suffix_pass=suffix_pass,
                    keep_columns=None if keep_columns is None else tuple(keep_columns),
                    max_prefix_cache_mb=max_prefix_cache_mb or DEFAULT_MAX_PREFIX_CACHE_MB,
                    metadata_prefix=metadata_prefix, device=device)
        self._routes = TaskRoutes.build(specs, task_column, dict(base)) if tasks is not None else None
        # one task: its config; routed: the first task's (same columns and settings as every task's)
        self._config = ClassifyConfig(task=task, **base) if self._routes is None else self._routes.configs[0][1]

    @property
    def config(self) -> ClassifyConfig:
        return self._config

    @property
    def routes(self) -> TaskRoutes | None:
        """The per-task configs of a routed step (None with one task)."""
        return self._routes

    def expand(self, rows):
        refuse_runner(rows, self.label)
        fields = input_fields(rows.element_type)
        refuse_missing_text(self._config, fields, self.label)
        names = [name for name, _ in fields or ()]
        # schema'd input: an earlier step's metadata columns are known now (dict rows: per row)
        config = self._config.for_input(names)
        routes = self._routes.for_input(names) if self._routes is not None else None
        if routes is None:
            labeled, failed = batched_step(rows, PrefixCachedClassifyDoFn(config, step_name=self.label),
                                           main=LABELED_TAG, label=self.label, step="Classify", **self._batching)
        else:  # grouped by task before batching: each forward pass runs over one prefix
            config = routes.configs[0][1]
            refuse_clashing_fields(config, fields, self.label)
            batching = {k: v for k, v in self._batching.items() if v is not None}
            stamped = rows | "KeepTimestamps" >> beam.Map(with_timestamp)
            keyed = stamped | "KeyByTask" >> beam.ParDo(KeyByTask(routes)).with_output_types(
                typing.Tuple[typing.Tuple[str, int], typing.Any]).with_outputs(FAILED_TAG, main="keyed")
            if rows.pipeline.options.view_as(StandardOptions).streaming:
                # per bundle, rows grouped by task inside each Beam batch: stateful batching
                # would hold rows past the watermark (on DirectRunner they then come out late)
                batched = keyed.keyed | "BatchPerBundle" >> beam.BatchElements(**batching)
            else:  # each task's rows batched together across the whole input
                batched = keyed.keyed | "BatchPerTask" >> beam.ParDo(BatchPerTask(self._batching["max_batch_size"]))
            classified = (
                batched
                | "Classify" >> beam.ParDo(RoutedClassifyDoFn(routes, step_name=self.label))
                .with_outputs(FAILED_TAG, main=LABELED_TAG))
            labeled = classified[LABELED_TAG]
            failed = (keyed[FAILED_TAG], classified[FAILED_TAG]) | "AllFailed" >> beam.Flatten()
        records = failed
        if fields:  # schema'd input: schema'd outputs (beam_prefix.beam.schemas)
            labeled, failed = as_rows(labeled, failed, labeled_type(config, fields), "LabeledRows",
                                      top_k=bool(config.top_k))
        return ClassifyResult(labeled=labeled, failed=failed, _records=records)


class ClassifyResult(StepResult):
    """`ClassifyText`'s outputs: ``result.labeled`` / ``result["labeled"]`` and
    ``result.failed`` / ``result["failed"]`` (a dict, as Beam YAML expects)."""
