"""`ClassifyText` and `ExtractFields` for Beam YAML pipelines.

A YAML pipeline names this module in a ``python`` provider; rows come in with a schema
and the outputs are addressable as ``ClassifyText.labeled`` and ``ClassifyText.failed``:

    providers:
      - type: python
        config: {}                  # or {packages: [beam-prefix]} where it is not installed
        transforms:
          ClassifyText: beam_prefix.yaml_provider.ClassifyText
    pipeline:
      transforms:
        - type: ClassifyText
          input: ReadTickets
          config:
            task: pipelines/tasks/support_tickets.yaml
            text_column: text
            error_handling: {output: errors}

``ExtractFields: beam_prefix.yaml_provider.ExtractFields`` works the same way, with
outputs ``ExtractFields.extracted`` and ``ExtractFields.failed`` (example:
``pipelines/yaml/extract_ticket_fields.yaml``).

With Beam YAML's ``error_handling: {output: NAME}``, output NAME carries the failed rows
in YAML's standard error format (``element``: the input row, ``msg``: reason and error,
``stack``: the stage), beside ``failed``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import apache_beam as beam
from apache_beam.typehints.row_type import RowTypeConstraint

from beam_prefix.extract_transform import ExtractFields as _ExtractFields
from beam_prefix.transforms import ClassifyText as _ClassifyText

__all__ = ["ClassifyText", "ExtractFields"]


class ClassifyText(beam.PTransform):
    """Classify text rows with a prefix-cached causal LM (see `beam_prefix.transforms.ClassifyText`).

    Args:
        task: path of a task YAML file.
        model: ``embedded`` (default: the task's), a model directory, ``.gguf`` or hub id.
        text_column: the column holding the text.
        id_column: optional id column echoed in failed rows.
        keep_columns: input columns copied to labelled rows (default: all).
        top_k: add a ``top_k`` column of the N best labels.
        prob_columns: one ``prob_<label>`` column per label (default: up to 32 labels).
        batch_size: rows per forward pass.
        max_batch_duration_secs: buffer rows across bundles this long (streaming).
        calibration, label_search, max_text_tokens, overflow, dtype, verify: as in the
            task file / `beam_prefix.transforms.ClassifyText`.
        error_handling: Beam YAML's ``{output: NAME}``: failed rows also go to NAME in
            YAML's error format.
    """

    def __init__(self, task: str, model: Optional[str] = None, text_column: str = "text",
                 id_column: Optional[str] = None, keep_columns: Optional[list] = None,
                 top_k: Optional[int] = None, prob_columns: Optional[bool] = None, batch_size: int = 16,
                 max_batch_duration_secs: Optional[float] = None, calibration: Optional[bool] = None,
                 label_search: Optional[str] = None, max_text_tokens: Optional[int] = None,
                 overflow: Optional[str] = None, dtype: str = "float32", verify: bool = True,
                 error_handling: Optional[Mapping[str, Any]] = None):
        super().__init__()
        self._classify = _ClassifyText(
            task=task, model=model, text_column=text_column, id_column=id_column, keep_columns=keep_columns,
            top_k=top_k, prob_columns=prob_columns, batch_size=batch_size,
            max_batch_duration_secs=max_batch_duration_secs, calibration=calibration, label_search=label_search,
            max_text_tokens=max_text_tokens, overflow=overflow, dtype=dtype, verify=verify)
        self._error_output = _error_output(error_handling)

    def expand(self, rows):
        result = rows | "ClassifyText" >> self._classify
        return _outputs(rows, {"labeled": result.labeled, "failed": result.failed}, self._error_output)


class ExtractFields(beam.PTransform):
    """Extract typed fields from text rows (see `beam_prefix.extract_transform.ExtractFields`).

    Args:
        task: path of a task file with ``kind: extract``.
        model: ``embedded`` (default: the task's), a model directory, ``.gguf`` or hub id.
        text_column, id_column, keep_columns, batch_size, max_batch_duration_secs,
            max_text_tokens, overflow, dtype, verify: as for `ClassifyText` here.
        max_new_tokens: override the task's output budget.
        error_handling: Beam YAML's ``{output: NAME}``, as for `ClassifyText` here.
    """

    def __init__(self, task: str, model: Optional[str] = None, text_column: str = "text",
                 id_column: Optional[str] = None, keep_columns: Optional[list] = None, batch_size: int = 64,
                 max_batch_duration_secs: Optional[float] = None, max_new_tokens: Optional[int] = None,
                 max_text_tokens: Optional[int] = None, overflow: Optional[str] = None, dtype: str = "float32",
                 verify: bool = True, error_handling: Optional[Mapping[str, Any]] = None):
        super().__init__()
        self._extract = _ExtractFields(
            task=task, model=model, text_column=text_column, id_column=id_column, keep_columns=keep_columns,
            batch_size=batch_size, max_batch_duration_secs=max_batch_duration_secs, max_new_tokens=max_new_tokens,
            max_text_tokens=max_text_tokens, overflow=overflow, dtype=dtype, verify=verify)
        self._error_output = _error_output(error_handling)

    def expand(self, rows):
        result = rows | "ExtractFields" >> self._extract
        return _outputs(rows, {"extracted": result.extracted, "failed": result.failed}, self._error_output)


def _error_output(error_handling: Optional[Mapping[str, Any]]) -> Optional[str]:
    if error_handling is not None and "output" not in error_handling:
        raise ValueError(f"error_handling needs an 'output' name, got {dict(error_handling)}")
    return error_handling["output"] if error_handling else None


def _outputs(rows, outputs: dict, error_output: Optional[str]) -> dict:
    """The step's outputs, plus the failed rows in YAML's error format under `error_output`."""
    if error_output:
        element_type = rows.element_type
        outputs[error_output] = outputs["failed"] | "ToYamlErrors" >> beam.Map(
            _yaml_error, _field_names(element_type)).with_output_types(
                RowTypeConstraint.from_fields([("element", element_type), ("msg", str), ("stack", str)]))
    return outputs


def _field_names(element_type) -> list[str]:
    return [name for name, _ in getattr(element_type, "_fields", [])]


def _yaml_error(failed: beam.Row, names: list[str]) -> beam.Row:
    import json

    try:
        row = json.loads(failed.row)
    except ValueError:
        row = {}
    element = beam.Row(**{n: row.get(n) for n in names}) if isinstance(row, dict) else beam.Row()
    return beam.Row(element=element, msg=f"{failed.reason}: {failed.error}", stack=failed.stage)
