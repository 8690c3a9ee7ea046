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
            task: support_tickets
            text_column: text
            error_handling: {output: errors}

``ExtractFields: beam_prefix.beam.yaml_provider.ExtractFields`` works the same way, with
outputs ``ExtractFields.extracted`` and ``ExtractFields.failed`` (example:
``pipelines/yaml/extract_ticket_fields.yaml``), and ``EmbedText`` with ``EmbedText.embedded``
(``pipelines/yaml/embed_tickets.yaml``). Every keyword of the Python transforms is a config
field of the same name (``threads``, ``min_batch_size``, ``tasks`` + ``task_column``,
``output_features``, ``label_tolerance``, ...).

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

import inspect
from typing import Any, ClassVar, Mapping, Optional

import apache_beam as beam
from apache_beam.typehints.row_type import RowTypeConstraint

from beam_prefix.beam.classify_transform import ClassifyText as _ClassifyText
from beam_prefix.beam.embed_transform import EmbedText as _EmbedText
from beam_prefix.beam.extract_transform import ExtractFields as _ExtractFields

__all__ = ["ClassifyText", "ExtractFields", "EmbedText"]


class _YamlStep(beam.PTransform):
    """A prefix-cached step for Beam YAML: its outputs, or with ``error_handling`` its main
    output and YAML's error output.

    Each subclass names the Python transform it wraps (`python`); its constructor takes
    every keyword of that transform, same names and defaults (``label`` aside: YAML names
    steps itself), plus ``error_handling``, so a YAML config cannot fall behind Python's."""

    main: ClassVar[str]
    python: ClassVar[type]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)

        def __init__(self, error_handling: Optional[Mapping[str, Any]] = None, **options):
            _YamlStep.__init__(self, error_handling, **options)

        # Beam YAML reads a transform's config fields from its constructor's signature:
        # show it the Python transform's keywords (annotations left out: they are strings
        # and unions Beam's schema inference does not read; values pass through as given)
        params = [p.replace(annotation=inspect.Parameter.empty)
                  for name, p in inspect.signature(cls.python.__init__).parameters.items() if name != "label"]
        params.append(inspect.Parameter("error_handling", inspect.Parameter.KEYWORD_ONLY, default=None))
        __init__.__signature__ = inspect.Signature(params)
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = __init__

    def __init__(self, error_handling: Optional[Mapping[str, Any]] = None, **options):
        super().__init__()
        self._step, self._error_output = type(self).python(**options), _error_output(error_handling)

    def expand(self, rows):
        return _outputs(rows, rows | type(self).__name__ >> self._step, self.main, self._error_output)


class ClassifyText(_YamlStep):
    """Classify text rows with a prefix-cached causal LM: every keyword of
    `beam_prefix.beam.classify_transform.ClassifyText` (same names and defaults), plus
    Beam YAML's ``error_handling``. Outputs ``labeled`` and ``failed``.

    Args:
        task: a shipped task's name (``support_tickets``, ...) or a task YAML file's path (or
            ``tasks`` + ``task_column``: a mapping of key -> task, or a directory of task
            files, for a task per row).
        model: ``embedded`` (default: the task's), a model directory, ``.gguf`` or hub id.
        text_column: the column holding the text.
        error_handling: Beam YAML's ``{output: NAME}``: failed rows go to NAME in YAML's
            error format (instead of ``failed``).
    """

    python = _ClassifyText
    main = "labeled"


class ExtractFields(_YamlStep):
    """Extract typed fields from text rows: every keyword of
    `beam_prefix.beam.extract_transform.ExtractFields`, plus ``error_handling``. Outputs
    ``extracted`` and ``failed``.

    Args:
        task: a shipped extraction task's name (``ticket_fields``) or the path of a task file
            with ``kind: extract``.
        model: ``embedded`` (default: the task's), a model directory, ``.gguf`` or hub id.
        text_column: the column holding the text.
        error_handling: Beam YAML's ``{output: NAME}``, as for `ClassifyText` here.
    """

    python = _ExtractFields
    main = "extracted"


class EmbedText(_YamlStep):
    """Feature vectors of text rows: every keyword of
    `beam_prefix.beam.embed_transform.EmbedText`, plus ``error_handling``. Outputs
    ``embedded`` (a ``features`` column) and ``failed``.

    Args:
        task: a shipped task's name or a task file's path: the prompt the rows are read after.
        layers: hidden-state indices whose states are concatenated (default ``[-1]``).
        pooling: ``last`` (the row's last position) or ``mean`` (over the row's suffix).
        error_handling: Beam YAML's ``{output: NAME}``, as for `ClassifyText` here.
    """

    python = _EmbedText
    main = "embedded"


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
