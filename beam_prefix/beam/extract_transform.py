"""`ExtractFields`: structured extraction as a Beam step, beside `ClassifyText`.

    result = rows | ExtractFields(task="ticket_fields", text_column="text")
    result.extracted  # input columns + one column per field, raw_output, truncated, prompt_fingerprint, model
    result.failed     # {"row", "id", "reason", "error", "stage"}

It runs like `ClassifyText` (the same row discipline, `PrefixStepDoFn`; the same model
per worker process, shared through `Shared`; the task's prefix built once per process and
self-checked): rows are batched with `beam.BatchElements`, and each batch is decoded by an
`Extractor`, `batch_size` rows at a time.

A task with ``scoring: head`` runs the same way with no decoding: its extraction head reads
the fields off each row's suffix pass (`engines.field_reading`), and ``raw_output`` holds
the spans it read (and why one did not parse as its field's type, which leaves it null).

Field columns are typed by the task: ``string``/``enum``/``date`` as str (dates ISO
``YYYY-MM-DD``), ``integer`` as int, ``number`` as float, ``boolean`` as bool; null where
the model said null (nullable fields only). A row whose output did not close within
`max_new_tokens` fails with reason ``max_new_tokens`` (its partial output in the error);
one whose closed output still fails the field checks (a February 29 of a common year)
fails with ``invalid_output``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from apache_beam.metrics import Metrics
from apache_beam.typehints.row_type import RowTypeConstraint

from beam_prefix.tasks.extract_task import ExtractionSpec, load_task
from beam_prefix.engines.extractor import Extraction, Extractor
from beam_prefix.beam.metrics import NAMESPACE
from beam_prefix.model.loading import EMBEDDED
from beam_prefix.beam.schemas import kept_fields
from beam_prefix.beam.step import PrefixStep, StepConfig, StepResult, batching_args, stamp
from beam_prefix.beam.worker import PrefixStepDoFn

__all__ = ["ExtractFields", "ExtractConfig", "ExtractFieldsDoFn", "EXTRACTED_TAG", "extracted_type"]

EXTRACTED_TAG = "extracted"
_PYTHON_TYPES = {"string": str, "enum": str, "date": str, "integer": int, "number": float, "boolean": bool}


@dataclasses.dataclass(frozen=True)
class ExtractConfig(StepConfig):
    """An extraction step's settings (those of `StepConfig`)."""

    DEFAULT_PREFIX = "extract_"
    engine = Extractor

    task: ExtractionSpec = None  # type: ignore[assignment]  (required: checked below)

    def __post_init__(self):
        if not isinstance(self.task, ExtractionSpec):
            raise ValueError(f"ExtractConfig needs an extraction task (kind: extract), got {type(self.task).__name__}")
        super().__post_init__()

    def added_columns(self) -> list[str]:
        """The columns extraction adds to each row, in order (unprefixed)."""
        version = ["task_version"] if self.task.version is not None else []
        return [*self.task.field_names, "raw_output", "truncated", *version, "prompt_fingerprint", "model"]


class ExtractFieldsDoFn(PrefixStepDoFn):
    """Extract fields from a batch (list) of rows; main output `extracted`, tagged `failed`."""

    def __init__(self, config: ExtractConfig, *, step_name: str = "ExtractFields"):
        super().__init__(config, step_name=step_name)

    def setup(self):
        super().setup()
        self._generated = Metrics.counter(NAMESPACE, "generated_tokens")
        self._extracted = Metrics.counter(NAMESPACE, "rows_extracted")

    def _call(self, extractor: Extractor, encoded: list) -> list[Extraction]:
        return extractor.extract_encoded(encoded)

    def _emit(self, extractor: Extractor, config: ExtractConfig, row: dict, result: Extraction, timestamp):
        self._generated.inc(result.generated_tokens)
        self._metrics.suffix_tokens_computed.inc(result.suffix_tokens)
        if not result.finished:
            yield self._failed(config, row, "max_new_tokens",
                               f"the output did not close within max_new_tokens={config.task.max_new_tokens}: "
                               f"{result.raw_output[:300]!r}", "model", timestamp)
            return
        if result.problem is not None:
            yield self._failed(config, row, "invalid_output", f"{result.problem}: {result.raw_output[:300]!r}",
                               "model", timestamp)
            return
        keep = config.keep_columns
        out = dict(row) if keep is None else {c: row.get(c) for c in keep}
        out.update(result.values)
        out["raw_output"] = result.raw_output
        out.update(config.metadata(extractor, result.truncated))
        self._extracted.inc()
        yield stamp(out, timestamp)


def extracted_type(config: ExtractConfig, fields) -> RowTypeConstraint:
    """The ``extracted`` row type for schema'd input `fields` ((name, type) pairs)."""
    fields = kept_fields(config, fields)
    added = [(f.name, Optional[_PYTHON_TYPES[f.type]] if f.nullable else _PYTHON_TYPES[f.type])
             for f in config.task.fields]
    added += [("raw_output", str), *config.metadata_fields()]
    return RowTypeConstraint.from_fields(list(fields) + added)


class ExtractFields(PrefixStep):
    """Extract typed fields from text rows with a prefix-cached causal LM.

    Args:
        task: a shipped extraction task's name (``ticket_fields``), the path of a task file
            with ``kind: extract``, or an `ExtractionSpec` (read at construction, so
            workers do not need the file).
        model: ``embedded`` (default: the task's model, else embedded), a directory, a
            ``.gguf`` file, a ``gs://`` directory or a hub id.
        text_column: as for `ClassifyText`.
        id_column: as for `ClassifyText`.
        dtype: as for `ClassifyText`.
        threads: as for `ClassifyText`.
        verify: as for `ClassifyText`.
        keep_columns: as for `ClassifyText`.
        device: as for `ClassifyText`.
        batch_size: rows decoded together (default 64; a whole number >= 1).
        min_batch_size: the smallest Beam batch (default `batch_size`: decoding wants
            full batches from the first one).
        max_batch_size: as for `ClassifyText`.
        max_batch_duration_secs: as for `ClassifyText`.
        max_text_tokens: overrides the task's token budget for one row's text.
        overflow: overrides the task's ``truncate`` or ``reject``.
        max_new_tokens: overrides the task's bound on generated tokens.
        metadata_prefix: a prefix for the metadata columns (``truncated``,
            ``task_version``, ``prompt_fingerprint``, ``model``). Default: none, unless the
            input already has such columns (``ClassifyText``'s labelled rows): then
            ``extract_``, so ExtractFields chains after ClassifyText with no arguments.
        label: the step's Beam label.

    Returns:
        an `ExtractResult` with ``extracted`` and ``failed`` (attributes or keys); each
        output row keeps its input row's timestamp. Schema'd input gives schema'd
        outputs (`extracted_type`; ``failed`` as for `ClassifyText`).
    """

    def __init__(self, task: ExtractionSpec | str | os.PathLike, *, model: str | None = None,
                 text_column: str = "text", id_column: str | None = None, dtype: str = "float32",
                 threads: int | None = None, min_batch_size: int | None = None, max_batch_size: int | None = None,
                 max_batch_duration_secs: float | None = None, batch_size: int = 64,
                 max_text_tokens: int | None = None, overflow: str | None = None, max_new_tokens: int | None = None,
                 verify: bool = True, keep_columns=None, metadata_prefix: str | None = None,
                 device: str = "cpu", label: str | None = None):
        spec = task if isinstance(task, ExtractionSpec) else load_task(task)
        if not isinstance(spec, ExtractionSpec):
            raise ValueError(f"ExtractFields needs a task with kind: extract; {task!r} is a classification task "
                             f"(use ClassifyText)")
        changes = {k: v for k, v in (("max_text_tokens", max_text_tokens), ("overflow", overflow),
                                     ("max_new_tokens", max_new_tokens)) if v is not None}
        if changes:
            spec = spec.replace(**changes)
        super().__init__(ExtractConfig(task=spec, model=model or spec.model or EMBEDDED, text_column=text_column,
                                       id_column=id_column, dtype=dtype, threads=threads, batch_size=batch_size,
                                       verify=verify, keep_columns=None if keep_columns is None else tuple(keep_columns),
                                       metadata_prefix=metadata_prefix, device=device),
                         batching_args(batch_size, min_batch_size, max_batch_size, max_batch_duration_secs,
                                       start_full=True), label)

    main, dofn, step, rows_step = EXTRACTED_TAG, ExtractFieldsDoFn, "Extract", "ExtractedRows"

    def row_type(self, config, fields):
        return extracted_type(config, fields)


class ExtractResult(StepResult):
    """`ExtractFields`' outputs: ``extracted`` and ``failed``, as attributes or keys."""


ExtractFields.result = ExtractResult
