"""Classification as a Beam step: `ClassifyConfig` and `PrefixCachedClassifyDoFn`.

`ClassifyConfig` adds to a step's settings (`step.StepConfig`) what classification
writes: ``label``, ``score``, one ``prob_<label>`` per label, the optional ``top_k``,
and the metadata columns. `PrefixCachedClassifyDoFn` is the worker's row discipline
(`worker.PrefixStepDoFn`) with a `PrefixClassifier` as its engine: it classifies a batch
of rows in one call and writes each prediction into its row. `ClassifyText`
(`beam_prefix.beam.classify_transform`) and routing (`beam_prefix.beam.routing`) build on these.
"""

from __future__ import annotations

import dataclasses
import re

from beam_prefix.engines.classifier import PrefixClassifier
from beam_prefix.model.suffix_graphs import check_suffix_pass, for_device
from beam_prefix.beam.step import FAILED_TAG, StepConfig, failed_record, stamp
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.beam.worker import PrefixStepDoFn

__all__ = ["PrefixCachedClassifyDoFn", "ClassifyConfig", "LABELED_TAG", "prob_column", "TOP_K_COLUMN", "FEATURES_COLUMN",
           "PROB_COLUMNS_MAX_LABELS", "FAILED_TAG", "failed_record"]

LABELED_TAG = "labeled"
# the optional list<struct{label, score}> column of the `top_k` best labels
TOP_K_COLUMN = "top_k"
# the optional list<float> column of each row's features (`ClassifyConfig.output_features`)
FEATURES_COLUMN = "features"
# per-label `prob_*` columns are on by default for tasks with at most this many labels
PROB_COLUMNS_MAX_LABELS = 32


def prob_column(label: str) -> str:
    """Output column holding a label's probability (BigQuery/Parquet-safe name)."""
    return "prob_" + re.sub(r"[^0-9A-Za-z_]", "_", label)


@dataclasses.dataclass(frozen=True)
class ClassifyConfig(StepConfig):
    """A classification step's settings (`StepConfig`'s, and these).

    Args:
        top_k: add a `top_k` column: the `top_k` most probable labels, best first, as
            ``[{"label": str, "score": float}, ...]`` (None or 0: no such column).
        prob_columns: one ``prob_<label>`` column per label; None (default): on for
            tasks of at most `PROB_COLUMNS_MAX_LABELS` labels.
        route: the task's key when rows are routed among several tasks (adds the
            ``task`` and ``task_version`` columns; see `beam_prefix.beam.routing`).
        output_features: add a ``features`` column: the row's features (what a trained
            head reads: `PrefixClassifier.embed`), computed by the same pass.
        suffix_pass: ``packed`` (default), ``buckets`` or ``graphs`` (CUDA graphs of the
            batches' fixed-shape passes: `beam_prefix.model.suffix_graphs`); ``graphs``
            needs a GPU device, and with ``device="auto"`` a worker without one runs packed.
    """

    DEFAULT_PREFIX = "classify_"
    engine = PrefixClassifier

    task: TaskSpec = None  # type: ignore[assignment]  (required: checked below)
    top_k: int | None = None
    prob_columns: bool | None = None
    route: str | None = None
    output_features: bool = False
    suffix_pass: str = "packed"

    def __post_init__(self):
        if not isinstance(self.task, TaskSpec):
            raise ValueError(f"ClassifyConfig needs a classification TaskSpec, got {type(self.task).__name__}")
        check_suffix_pass(self.suffix_pass, self.device)
        if self.prob_columns is None:
            object.__setattr__(self, "prob_columns", len(self.task.labels) <= PROB_COLUMNS_MAX_LABELS)
        columns = [prob_column(n) for n in self.task.label_names]
        if self.prob_columns and len(set(columns)) != len(columns):
            raise ValueError(f"labels {self.task.label_names} map to clashing column names {columns}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be a whole number >= 1 (the best labels in a top_k column; leave it "
                             f"out, None, for no such column), got {self.top_k!r}")
        super().__post_init__()

    @property
    def engine_options(self) -> dict:
        return {"suffix_pass": self.suffix_pass}

    def build_engine(self, loaded):
        """`StepConfig.build_engine`; graphs where ``device="auto"`` found no GPU run packed."""
        placed = for_device(self.suffix_pass, self.device, next(loaded.model.parameters()).device)
        config = self if placed == self.suffix_pass else dataclasses.replace(self, suffix_pass=placed)
        return StepConfig.build_engine(config, loaded)

    def added_columns(self) -> list[str]:
        """The columns classification adds to each labelled row, in order (unprefixed)."""
        probs = [prob_column(n) for n in self.task.label_names] if self.prob_columns else []
        top = [TOP_K_COLUMN] if self.top_k else []
        task = ["task"] if self.route is not None else []
        version = ["task_version"] if self.route is not None or self.task.version is not None else []
        features = [FEATURES_COLUMN] if self.output_features else []
        return ["label", "score", *probs, *top, *features, "truncated", *task, *version, "prompt_fingerprint",
                "model"]


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
        return clf.classify_encoded(encoded, features=self.config.output_features)

    def _emit(self, clf: PrefixClassifier, config: ClassifyConfig, row: dict, pred, timestamp):
        self._metrics.suffix_tokens_computed.inc(pred.suffix_tokens)
        self._metrics.label_tokens_computed.inc(pred.label_tokens)
        self._metrics.rows_classified.inc()
        yield stamp(_labeled(clf, config, row, pred), timestamp)


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
    if config.output_features:
        out[FEATURES_COLUMN] = list(pred.features)
    if config.route is None:
        out.update(config.metadata(clf, pred.truncated))
    else:  # routed rows always say their task and its version
        out[config.column("truncated")] = pred.truncated
        out[config.column("task")] = config.route
        out[config.column("task_version")] = config.task.version
        out[config.column("prompt_fingerprint")] = clf.fingerprint
        out[config.column("model")] = clf.model_id
    return out
