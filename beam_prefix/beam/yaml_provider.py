"""`ClassifyText` and `ExtractFields` for Beam YAML pipelines.

A YAML pipeline names this module in a ``python`` provider; rows come in with a schema
and the outputs are addressable as ``ClassifyText.labeled`` and ``ClassifyText.failed``:

    providers:
      - type: python
        config: {}                  # or {packages: [beam-prefix]} where it is not installed
        transforms:
          ClassifyText: beam_prefix.beam.yaml_provider.ClassifyText
    pipeline:
      transforms:
        - type: ClassifyText
          input: ReadTickets
          config:
            task: pipelines/tasks/support_tickets.yaml
            text_column: text
            error_handling: {output: errors}

``ExtractFields: beam_prefix.beam.yaml_provider.ExtractFields`` works the same way, with
outputs ``ExtractFields.extracted`` and ``ExtractFields.failed`` (example:
``pipelines/yaml/extract_ticket_fields.yaml``).

With Beam YAML's ``error_handling: {output: NAME}``, output NAME carries the failed rows
in YAML's standard error format (``element``: the input row, nested fields as they came,
``msg``: reason and error, ``stack``: the stage) *instead of* ``failed``: the step then
has two outputs, its main one and NAME, as Beam's own YAML transforms with error handling
do, so in a ``type: chain`` the next transform reads the main output (``labeled`` or
``extracted``) and NAME is consumed in the chain's ``extra_transforms``
(``pipelines/yaml/classify_then_extract_chain.yaml``). Without ``error_handling`` the
outputs are the main one and ``failed`` (name them: ``ClassifyText.labeled``).

Chained steps (``ClassifyText`` then ``ExtractFields`` on its labelled rows) need no extra
arguments: the second step's metadata columns (``truncated``, ``prompt_fingerprint``,
``model``, ...) get its prefix (``extract_``) beside the first's (`metadata_prefix`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Optional

import apache_beam as beam
from apache_beam.typehints.row_type import RowTypeConstraint

from beam_prefix.beam.extract_transform import ExtractFields as _ExtractFields
from beam_prefix.beam.classify_transform import ClassifyText as _ClassifyText

__all__ = ["ClassifyText", "ExtractFields"]


class _YamlStep(beam.PTransform):
    """A prefix-cached step for Beam YAML: its outputs, or with ``error_handling`` its main
    output and YAML's error output."""

    main: ClassVar[str]

    def __init__(self, step: beam.PTransform, error_handling: Optional[Mapping[str, Any]]):
        super().__init__()
        self._step, self._error_output = step, _error_output(error_handling)

    def expand(self, rows):
        return _outputs(rows, rows | type(self).__name__ >> self._step, self.main, self._error_output)


class ClassifyText(_YamlStep):
    """Classify text rows with a prefix-cached causal LM (see `beam_prefix.beam.classify_transform.ClassifyText`).

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
        calibration, label_search, max_text_tokens, overflow, dtype, verify,
            metadata_prefix, device: as in the task file / `beam_prefix.beam.classify_transform.ClassifyText`.
        error_handling: Beam YAML's ``{output: NAME}``: failed rows go to NAME in YAML's
            error format (instead of ``failed``).
    """

    def __init__(self, task: str, model: Optional[str] = None, text_column: str = "text",
                 id_column: Optional[str] = None, keep_columns: Optional[list] = None,
                 top_k: Optional[int] = None, prob_columns: Optional[bool] = None, batch_size: int = 16,
                 max_batch_duration_secs: Optional[float] = None, calibration: Optional[bool] = None,
                 label_search: Optional[str] = None, max_text_tokens: Optional[int] = None,
                 overflow: Optional[str] = None, dtype: str = "float32", verify: bool = True,
                 metadata_prefix: Optional[str] = None, device: str = "cpu",
                 error_handling: Optional[Mapping[str, Any]] = None):
        super().__init__(_ClassifyText(
            task=task, model=model, text_column=text_column, id_column=id_column, keep_columns=keep_columns,
            top_k=top_k, prob_columns=prob_columns, batch_size=batch_size,
            max_batch_duration_secs=max_batch_duration_secs, calibration=calibration, label_search=label_search,
            max_text_tokens=max_text_tokens, overflow=overflow, dtype=dtype, verify=verify,
            metadata_prefix=metadata_prefix, device=device), error_handling)

    main = "labeled"


class ExtractFields(_YamlStep):
    """Extract typed fields from text rows (see `beam_prefix.beam.extract_transform.ExtractFields`).

    Args:
        task: path of a task file with ``kind: extract``.
        model: ``embedded`` (default: the task's), a model directory, ``.gguf`` or hub id.
        text_column, id_column, keep_columns, batch_size, max_batch_duration_secs,
            max_text_tokens, overflow, dtype, verify: as for `ClassifyText` here.
        max_new_tokens: override the task's output budget.
        metadata_prefix, device: as for `beam_prefix.beam.extract_transform.ExtractFields`.
        error_handling: Beam YAML's ``{output: NAME}``, as for `ClassifyText` here.
    """

    def __init__(self, task: str, model: Optional[str] = None, text_column: str = "text",
                 id_column: Optional[str] = None, keep_columns: Optional[list] = None, batch_size: int = 64,
                 max_batch_duration_secs: Optional[float] = None, max_new_tokens: Optional[int] = None,
                 max_text_tokens: Optional[int] = None, overflow: Optional[str] = None, dtype: str = "float32",
                 verify: bool = True, metadata_prefix: Optional[str] = None, device: str = "cpu",
                 error_handling: Optional[Mapping[str, Any]] = None):
        super().__init__(_ExtractFields(
            task=task, model=model, text_column=text_column, id_column=id_column, keep_columns=keep_columns,
            batch_size=batch_size, max_batch_duration_secs=max_batch_duration_secs, max_new_tokens=max_new_tokens,
            max_text_tokens=max_text_tokens, overflow=overflow, dtype=dtype, verify=verify,
            metadata_prefix=metadata_prefix, device=device), error_handling)

    main = "extracted"


def _error_output(error_handling: Optional[Mapping[str, Any]]) -> Optional[str]:
    if error_handling is not None and "output" not in error_handling:
        raise ValueError(f"error_handling needs an 'output' name, got {dict(error_handling)}")
    return error_handling["output"] if error_handling else None


def _outputs(rows, result, main: str, error_output: Optional[str]) -> dict:
    """The step's main output and ``failed``; with `error_output`, the main output and the
    failed rows in YAML's error format under that name instead."""
    if not error_output:
        return {main: result[main], "failed": result.failed}
    errors = result.failed_records | "ToYamlErrors" >> beam.Map(_yaml_error, _field_names(rows.element_type)) \
        .with_output_types(RowTypeConstraint.from_fields([("element", rows.element_type), ("msg", str),
                                                          ("stack", str)]))
    return {main: result[main], error_output: errors}


def _field_names(element_type) -> list[str]:
    return [name for name, _ in getattr(element_type, "_fields", [])]


def _yaml_error(failed: dict, names: list[str]) -> beam.Row:
    """A failed record -> YAML's error row; `element` is the input row's own values."""
    row = failed.get("row")
    values = row if isinstance(row, dict) else {}
    return beam.Row(element=beam.Row(**{n: values.get(n) for n in names}),
                    msg=f"{failed['reason']}: {failed['error']}", stack=failed["stage"])
