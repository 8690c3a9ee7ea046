"""`EmbedText`: each row's feature vector from the cached forward, as a Beam step.

    result = rows | EmbedText(task="support_tickets", layers=(-1,))
    result.embedded  # input columns + features (list of floats), truncated, prompt_fingerprint, model
    result.failed    # {"row", "id", "reason", "error", "stage"}

The features are what a trained head reads (`beam_prefix.tasks.trained_head`): the hidden
state(s) at each row's last prompt position, after the task's whole prompt, computed
exactly as classification computes them (one suffix pass over the cached prefix, the same
engine, the same row discipline). Use them to cluster, deduplicate or train a model of
your own downstream; `pipelines.fit` uses them to fit a head.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Sequence

from apache_beam.typehints.row_type import RowTypeConstraint

from beam_prefix.engines.classifier import PrefixClassifier
from beam_prefix.engines.predictions import Embedding
from beam_prefix.model.loading import EMBEDDED
from beam_prefix.beam.schemas import kept_fields
from beam_prefix.beam.step import PrefixStep, StepConfig, batching_args, stamp
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.tasks.trained_head import EMBED_POOLINGS
from beam_prefix.beam.worker import PrefixStepDoFn

__all__ = ["EmbedText", "EmbedConfig", "EmbedDoFn", "EMBEDDED_TAG", "FEATURES_COLUMN", "features_task"]

EMBEDDED_TAG = "embedded"
FEATURES_COLUMN = "features"


def features_task(task: TaskSpec) -> TaskSpec:
    """The task whose prompt the features come from, scored the plain way: features do not
    depend on how labels are scored (nor on calibration), and a head being fit has no
    head file yet."""
    return task.replace(scoring="auto", head=None, calibration=False)


@dataclasses.dataclass(frozen=True)
class EmbedConfig(StepConfig):
    """An embedding step's settings (`StepConfig`'s, and `layers`: the hidden-state indices
    read at each row's last position, ``-1`` the final normalised state)."""

    DEFAULT_PREFIX = "embed_"
    engine = PrefixClassifier

    task: TaskSpec = None  # type: ignore[assignment]  (required: checked below)
    layers: tuple[int, ...] = (-1,)
    pooling: str = "last"  # "mean": over the row's suffix positions; "last+mean": both (trained_head.EMBED_POOLINGS)

    def __post_init__(self):
        if not isinstance(self.task, TaskSpec):
            raise ValueError(f"EmbedConfig needs a classification TaskSpec, got {type(self.task).__name__}")
        layers = tuple(self.layers)
        if not layers or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError(f"layers must be a non-empty sequence of hidden-state indices, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)
        if self.pooling not in EMBED_POOLINGS:
            raise ValueError(f"pooling must be one of {EMBED_POOLINGS}, got {self.pooling!r}")
        object.__setattr__(self, "task", features_task(self.task))
        super().__post_init__()

    def added_columns(self) -> list[str]:
        version = ["task_version"] if self.task.version is not None else []
        return [FEATURES_COLUMN, "truncated", *version, "prompt_fingerprint", "model"]

    def check_fits(self) -> None:
        """At launch: the prompt fits the model, and the model has the hidden states `layers` names."""
        self.engine.check_fits(self.task, self.model, dtype=self.dtype, layers=self.layers)

    @property
    def engine_options(self) -> dict:
        """A classifier over the task's prompt whose start-up self-check compares these features."""
        return {"check_layers": self.layers, "check_pooling": self.pooling}


class EmbedDoFn(PrefixStepDoFn):
    """Features of a batch (list) of rows; main output `embedded`, tagged `failed`."""

    def __init__(self, config: EmbedConfig, *, step_name: str = "EmbedText"):
        super().__init__(config, step_name=step_name)

    def _call(self, clf: PrefixClassifier, encoded: list) -> list[Embedding]:
        return clf.embed_encoded(encoded, layers=self.config.layers, pooling=self.config.pooling)

    def _emit(self, clf: PrefixClassifier, config: EmbedConfig, row: dict, result: Embedding, timestamp):
        self._metrics.suffix_tokens_computed.inc(result.suffix_tokens)
        self._metrics.rows_embedded.inc()
        keep = config.keep_columns
        out = dict(row) if keep is None else {c: row.get(c) for c in keep}
        out[FEATURES_COLUMN] = list(result.features)
        out.update(config.metadata(clf, result.truncated))
        yield stamp(out, timestamp)


def embedded_type(config: EmbedConfig, fields) -> RowTypeConstraint:
    """The ``embedded`` row type for schema'd input `fields`."""
    added = [(FEATURES_COLUMN, typing.List[float]), *config.metadata_fields()]
    return RowTypeConstraint.from_fields(list(kept_fields(config, fields)) + added)


class EmbedText(PrefixStep):
    """Feature vectors of text rows from a prefix-cached causal LM.

    Args:
        task: a shipped task's name, a task file's path or a `TaskSpec`: the prompt the
            rows are read after.
        layers: hidden-state indices read at each row's last position (default ``(-1,)``,
            the final normalised state; e.g. ``(-1, 20)`` adds layer 20's output).
        pooling: ``last`` (default) reads them at the row's last position; ``mean``
            averages them over the row's suffix positions (its text and the template's
            closing tokens), which a head reads better from (docs/heads.md).
        model: as for `ClassifyText`.
        text_column: as for `ClassifyText`.
        id_column: as for `ClassifyText`.
        dtype: as for `ClassifyText`.
        threads: as for `ClassifyText`.
        batch_size: as for `ClassifyText`.
        min_batch_size: as for `ClassifyText`.
        max_batch_size: as for `ClassifyText`.
        max_batch_duration_secs: as for `ClassifyText`.
        max_text_tokens: as for `ClassifyText`.
        overflow: as for `ClassifyText`.
        verify: as for `ClassifyText`.
        keep_columns: as for `ClassifyText`.
        metadata_prefix: as for `ClassifyText`.
        device: as for `ClassifyText`.
        label: the step's Beam label.

    Returns:
        a `step.StepResult` with ``embedded`` and ``failed``; schema'd input gives schema'd
        outputs (``features: List[float]``).
    """

    def __init__(self, task: TaskSpec | str | os.PathLike, *, layers: Sequence[int] = (-1,), model: str | None = None,
                 text_column: str = "text", id_column: str | None = None, dtype: str = "float32",
                 threads: int | None = None, batch_size: int = 16, min_batch_size: int | None = None,
                 max_batch_size: int | None = None, max_batch_duration_secs: float | None = None,
                 max_text_tokens: int | None = None, overflow: str | None = None, verify: bool = True,
                 keep_columns=None, metadata_prefix: str | None = None, device: str = "cpu",
                 label: str | None = None, pooling: str = "last"):
        spec = task if isinstance(task, TaskSpec) else TaskSpec.from_yaml(task)
        changes = {k: v for k, v in (("max_text_tokens", max_text_tokens), ("overflow", overflow)) if v is not None}
        if changes:
            spec = spec.replace(**changes)
        super().__init__(EmbedConfig(task=spec, layers=tuple(layers), pooling=pooling, model=model or spec.model or EMBEDDED,
                                     text_column=text_column, id_column=id_column, dtype=dtype, threads=threads,
                                     batch_size=batch_size, verify=verify, device=device,
                                     keep_columns=None if keep_columns is None else tuple(keep_columns),
                                     metadata_prefix=metadata_prefix),
                         batching_args(batch_size, min_batch_size, max_batch_size, max_batch_duration_secs), label)

    main, dofn, step, rows_step = EMBEDDED_TAG, EmbedDoFn, "Embed", "EmbeddedRows"

    def row_type(self, config, fields):
        return embedded_type(config, fields)
