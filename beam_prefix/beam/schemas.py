"""Beam schemas of `ClassifyText`'s outputs, for input with a schema.

When the input PCollection has a schema (`beam.Row`s, a NamedTuple type), ``labeled``
and ``failed`` are schema'd too, so `beam.Select`, `beam.dataframe` and schema-aware
sinks work on them:

- ``labeled``: the input's fields (or only ``keep_columns``), with their types, then
  ``label: str``, ``score: float``, ``prob_<label>: float`` per label (when on),
  ``top_k: List[Row(label: str, score: float)]`` (with ``top_k``), ``truncated: bool``,
  ``task: str`` and ``task_version: Optional[str]`` (routed steps; the version also for a
  versioned task), ``prompt_fingerprint: str``, ``model: str``.
- ``failed``: ``row: str`` (the input row as JSON text), ``id: Optional[str]``,
  ``reason: str``, ``error: str``, ``stage: str``.

Dict rows have no schema: their outputs stay dicts (the same names and values). For the
sinks that need a schema of their own: `bigquery_schema` and `bigquery_row` for
``WriteToBigQuery``, `parquet_schema` and `parquet_row` for ``WriteToParquet`` (which
cannot convert a nested `beam.Row`, such as a ``top_k`` entry, by itself).
"""

from __future__ import annotations

import datetime
import json
import typing
from typing import Any, Optional, Sequence

import apache_beam as beam
from apache_beam.typehints import schemas
from apache_beam.typehints.row_type import RowTypeConstraint

__all__ = ["input_fields", "kept_fields", "labeled_type", "FAILED_TYPE", "TOP_K_ENTRY", "ToRow", "failed_row", "failed_values", "json_text",
           "bigquery_schema", "bigquery_row", "parquet_schema", "parquet_row"]

TOP_K_ENTRY = RowTypeConstraint.from_fields([("label", str), ("score", float)])
FAILED_TYPE = RowTypeConstraint.from_fields([
    ("row", str), ("id", Optional[str]), ("reason", str), ("error", str), ("stage", str)])


def input_fields(element_type) -> list[tuple[str, Any]] | None:
    """(name, type) of each field of a schema'd element type; None without a schema.

    A NamedTuple class written under ``from __future__ import annotations`` has string
    annotations, which Beam reads as ``Any``: they are resolved here (`typing.get_type_hints`).

    Raises:
        ValueError: such annotations that cannot be resolved (a name not visible from the
            class's module), with what to do.
    """
    hints = _named_tuple_hints(element_type)
    if hints is not None:
        return [(name, hints[name]) for name in element_type._fields]
    try:
        return list(schemas.named_fields_from_element_type(element_type))
    except Exception:  # noqa: BLE001 - Any, dict, str...: no schema
        return None


def _named_tuple_hints(element_type) -> dict | None:
    """The resolved annotations of a NamedTuple class whose annotations are strings, else None."""
    annotations = getattr(element_type, "__annotations__", None)
    if not (isinstance(element_type, type) and issubclass(element_type, tuple) and hasattr(element_type, "_fields")
            and annotations and any(isinstance(a, (str, typing.ForwardRef)) for a in annotations.values())):
        return None
    try:
        return typing.get_type_hints(element_type)
    except Exception as e:  # noqa: BLE001 - NameError and friends
        raise ValueError(
            f"the fields of NamedTuple {element_type.__name__} are annotated with strings (from __future__ import "
            f"annotations) that cannot be resolved ({type(e).__name__}: {e}); define it where those names are "
            f"visible, or as typing.NamedTuple({element_type.__name__!r}, [(name, type), ...])") from None


def kept_fields(config, fields: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The input `fields` a step's output rows carry: all, or the config's `keep_columns`."""
    types = dict(fields)
    if config.keep_columns is None:
        return list(fields)
    missing = [c for c in config.keep_columns if c not in types]
    if missing:
        raise ValueError(f"keep_columns {missing} are not fields of the input (fields: {list(types)})")
    return [(c, types[c]) for c in config.keep_columns]


def labeled_type(config, fields: Sequence[tuple[str, Any]]) -> RowTypeConstraint:
    """The ``labeled`` row type for input `fields` and a `ClassifyConfig`."""
    fields = kept_fields(config, fields)
    added = {"label": str, "score": float, "truncated": bool, "prompt_fingerprint": str, "model": str,
             "top_k": typing.List[TOP_K_ENTRY], "task": str, "task_version": Optional[str],
             "features": typing.List[float]}
    return RowTypeConstraint.from_fields(
        list(fields) + [(config.column(name), added.get(name, float))  # prob_*: float
                        for name in config.added_columns()])


class ToRow:
    """A step's output dict -> a `beam.Row` of the given type's fields, in order.

    Args:
        row_type: the output row type.
        top_k: the step wrote its own ``top_k`` column (a list of dicts, made Rows here); an
            input column of that name (an earlier step's, already Rows) is left as it is.
    """

    def __init__(self, row_type: RowTypeConstraint, *, top_k: bool = False):
        self._names = [name for name, _ in row_type._fields]
        self._top_k = top_k

    def __call__(self, row: dict) -> beam.Row:
        values = {name: row.get(name) for name in self._names}
        if self._top_k and values.get("top_k") is not None:
            values["top_k"] = [beam.Row(label=e["label"], score=e["score"]) for e in values["top_k"]]
        return beam.Row(**values)


def _json_default(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, beam.Row):
        return value.as_dict()
    return str(value)  # Decimal, numpy scalars...


def json_text(value) -> str:
    """JSON text, UTF-8 clean: a lone surrogate (which no UTF-8 writer accepts) stays as its
    JSON escape (``\\ud800``), so a failed row holding one can still be written."""
    text = json.dumps(value, ensure_ascii=False, default=_json_default)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, ensure_ascii=True, default=_json_default)
    return text


def failed_values(record: dict) -> dict:
    """A failed record (``{"row", "id", "reason", "error", "stage"}``) as the failed
    output's text columns: ``id`` (as text), ``reason``, ``error``, ``stage``, ``row`` (JSON)."""
    id_value = record.get("id")
    return {"id": None if id_value is None else (id_value if isinstance(id_value, str) else json_text(id_value)),
            "reason": record["reason"], "error": record["error"], "stage": record["stage"],
            "row": json_text(record.get("row"))}


def failed_row(record: dict) -> beam.Row:
    """A failed record -> a `FAILED_TYPE` row."""
    values = failed_values(record)
    return beam.Row(**{name: values[name] for name, _ in FAILED_TYPE._fields})


# Beam atomic types -> BigQuery column types (the rest, e.g. logical types, as STRING)
_BQ_TYPES = {"BYTE": "INTEGER", "INT16": "INTEGER", "INT32": "INTEGER", "INT64": "INTEGER", "FLOAT": "FLOAT",
             "DOUBLE": "FLOAT", "STRING": "STRING", "BOOLEAN": "BOOLEAN", "BYTES": "BYTES"}


def bigquery_schema(row_type) -> dict:
    """The BigQuery table schema (``{"fields": [...]}``) of a schema'd PCollection's element
    type, e.g. ``WriteToBigQuery(table, schema=bigquery_schema(result.labeled.element_type))``
    (Beam's FILE_LOADS and STREAMING_INSERTS need one; STORAGE_WRITE_API derives its own)."""
    return {"fields": [_bigquery_field(f.name, f.type) for f in schemas.schema_from_element_type(row_type).fields]}


def _bigquery_field(name: str, field_type, mode: str | None = None) -> dict:
    from apache_beam.portability.api import schema_pb2

    kind = field_type.WhichOneof("type_info")
    mode = mode or ("NULLABLE" if field_type.nullable else "REQUIRED")
    if kind == "array_type":
        return _bigquery_field(name, field_type.array_type.element_type, "REPEATED")
    if kind == "row_type":
        return {"name": name, "type": "RECORD", "mode": mode,
                "fields": [_bigquery_field(f.name, f.type) for f in field_type.row_type.schema.fields]}
    atomic = schema_pb2.AtomicType.Name(field_type.atomic_type) if kind == "atomic_type" else ""
    return {"name": name, "type": _BQ_TYPES.get(atomic, "STRING"), "mode": mode}


def bigquery_row(row: beam.Row) -> dict:
    """A `beam.Row` as BigQuery's JSON row (nested rows as dicts, bytes as base64)."""
    import base64

    return _as_dicts(row, lambda v: base64.b64encode(bytes(v)).decode("ascii")
                     if isinstance(v, (bytes, bytearray)) else v)


def _as_dicts(value, leaf=lambda v: v):
    """`value` with every `beam.Row` in it as a dict and every sequence as a list; `leaf`
    applied to everything else."""
    if isinstance(value, beam.Row):
        return {k: _as_dicts(x, leaf) for k, x in value.as_dict().items()}
    if isinstance(value, (list, tuple)):
        return [_as_dicts(x, leaf) for x in value]
    return leaf(value)


# Beam's atomic types -> Arrow's (what WriteToParquet writes)
_ARROW_TYPES = {"BYTE": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FLOAT": "float32",
                "DOUBLE": "float64", "STRING": "string", "BOOLEAN": "bool_", "BYTES": "binary"}
_ARROW_LOGICAL = {"beam:logical_type:micros_instant:v1": ("timestamp", "us", "UTC"),
                  "beam:logical_type:millis_instant:v1": ("timestamp", "ms", "UTC"),
                  "beam:logical_type:date:v1": ("date32",)}


def parquet_schema(row_type):
    """The Arrow schema (a ``pyarrow.Schema``) of a schema'd PCollection's element type, for
    ``WriteToParquet``: ``labeled | beam.Map(parquet_row) | WriteToParquet(path,
    parquet_schema(labeled.element_type))``. Nested rows (``top_k`` entries) are structs,
    lists are lists, nullable fields nullable."""
    import pyarrow as pa

    return pa.schema([_arrow_field(f.name, f.type) for f in schemas.schema_from_element_type(row_type).fields])


def _arrow_field(name: str, field_type):
    import pyarrow as pa

    return pa.field(name, _arrow_type(field_type), nullable=field_type.nullable)


def _arrow_type(field_type):
    import pyarrow as pa
    from apache_beam.portability.api import schema_pb2

    kind = field_type.WhichOneof("type_info")
    if kind == "array_type" or kind == "iterable_type":
        inner = field_type.array_type if kind == "array_type" else field_type.iterable_type
        return pa.list_(_arrow_field("item", inner.element_type))
    if kind == "row_type":
        return pa.struct([_arrow_field(f.name, f.type) for f in field_type.row_type.schema.fields])
    if kind == "map_type":
        return pa.map_(_arrow_type(field_type.map_type.key_type), _arrow_type(field_type.map_type.value_type))
    if kind == "logical_type":
        known = _ARROW_LOGICAL.get(field_type.logical_type.urn)
        if known is not None:
            return getattr(pa, known[0])(*known[1:])
        return _arrow_type(field_type.logical_type.representation)
    atomic = schema_pb2.AtomicType.Name(field_type.atomic_type)
    return getattr(pa, _ARROW_TYPES.get(atomic, "string"))()


def parquet_row(row: beam.Row) -> dict:
    """A `beam.Row` as the dict ``WriteToParquet`` writes (nested rows as dicts)."""
    return _as_dicts(row)
