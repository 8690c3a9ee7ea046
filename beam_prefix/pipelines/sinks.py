"""Output schemas and writers: Parquet, JSONL or BigQuery, for labelled and failed rows.

Labelled rows: the kept input columns (their input types where the input has a schema,
else strings), then ``label``, ``score``, one ``prob_<label>`` per label (``--prob_columns``),
``top_k`` (``--top_k N``: a list of ``{label, score}`` structs, REPEATED RECORD in
BigQuery), ``truncated``, ``prompt_fingerprint`` and ``model``. Failed rows: ``id``, ``reason``, ``error``,
``stage`` and ``row`` (the whole input row as JSON text). One Arrow schema describes each
output; the BigQuery schema is derived from it, so every sink writes the same columns.

File sinks are Beam's; `pipelines.classify` points them at a staging directory and
publishes the files only when the whole run succeeded (`pipelines.publish`).
"""

from __future__ import annotations

import base64
import datetime
import decimal

import apache_beam as beam
import pyarrow as pa
from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix.beam.classify_dofn import FAILED_TAG, TOP_K_COLUMN, ClassifyConfig, failed_record
from beam_prefix.beam.schemas import failed_values
from beam_prefix.beam.schemas import json_text as to_json  # the pipelines' name for it
from beam_prefix.pipelines.options import StepOptions
from beam_prefix.pipelines.sources import require_columns
from beam_prefix.pipelines.summary import STASHED_KEYS

__all__ = ["kept_columns", "labeled_schema", "FAILED_SCHEMA", "ToOutputRow", "failed_output_row",
           "bigquery_schema", "bigquery_write_args", "write", "Destination", "destinations", "to_json"]

FAILED_SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("reason", pa.string()), pa.field("error", pa.string()),
    pa.field("stage", pa.string()), pa.field("row", pa.string()),
])


def kept_columns(options: PipelineOptions, schema: pa.Schema | None, reserved=None) -> list[pa.Field]:
    """The input columns copied to the labelled (or extracted) output, with their types.

    Args:
        options: the pipeline options (``--columns_to_keep``, ``--id_column``, ``--text_column``).
        schema: the input's schema where known at launch, else None (columns become strings).
        reserved: the output columns a kept column may not be named like (default:
            classification's, ``prob_*`` included).
    """
    o = options.view_as(StepOptions)
    if o.columns_to_keep and o.columns_to_keep.strip() == "*":
        if schema is None:
            raise ValueError("--columns_to_keep='*' needs an input whose columns are known at launch "
                             "(Parquet, CSV or a BigQuery table); list the columns instead")
        names = list(schema.names)
    elif o.columns_to_keep:
        names = [c.strip() for c in o.columns_to_keep.split(",") if c.strip()]
    else:
        names = [c for c in (o.id_column, o.text_column) if c]
    require_columns(options, schema, {"--columns_to_keep": names if o.columns_to_keep else [],
                                      "--text_column": [o.text_column], "--id_column": [o.id_column]})
    if reserved is None:
        reserved = {"label", "score", "truncated", "prompt_fingerprint", "model", TOP_K_COLUMN}
        clash = [n for n in names if n in reserved or n.startswith("prob_")]
    else:
        clash = [n for n in names if n in set(reserved)]
    if clash:
        raise ValueError(f"kept columns {clash} clash with output columns; leave them out of --columns_to_keep")
    return [schema.field(n) if schema is not None else pa.field(n, pa.string()) for n in dict.fromkeys(names)]


TOP_K_TYPE = pa.list_(pa.struct([pa.field("label", pa.string()), pa.field("score", pa.float64())]))
_ADDED_TYPES = {"label": pa.string(), "score": pa.float64(), TOP_K_COLUMN: TOP_K_TYPE, "truncated": pa.bool_(),
                "features": pa.list_(pa.float32()),
                "task": pa.string(), "task_version": pa.string(), "prompt_fingerprint": pa.string(),
                "model": pa.string()}


def labeled_schema(config: ClassifyConfig, kept: list[pa.Field]) -> pa.Schema:
    """Arrow schema of the labelled output: the kept columns, then what `config` adds."""
    return pa.schema(list(kept) + [pa.field(name, _ADDED_TYPES.get(name, pa.float64()))  # prob_*: float64
                                   for name in config.output_columns])


class ToOutputRow(beam.DoFn):
    """A labelled row -> exactly the output schema's columns, values of the column's type.

    A kept value that does not fit its column (two input files with different types)
    sends the row to the failed output (reason ``output_type``) instead of failing the write.
    """

    def __init__(self, schema: pa.Schema, kept: list[pa.Field], typed: bool, id_column: str | None,
                 on_labeled=None):
        self._on_labeled = on_labeled  # called with each (full) row that goes out labelled
        self._kept = [(f.name, f.type) for f in kept]
        self._added = schema.names[len(kept):]  # the classification columns
        self._typed = typed
        self._id_column = id_column

    def process(self, row: dict):
        out = {}
        for name, type_ in self._kept:
            value = row.get(name)
            if value is not None and not self._typed:
                value = value if isinstance(value, str) else to_json(value)
            elif value is not None:
                try:
                    pa.array([value], type=type_)
                except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
                    input_row = {k: v for k, v in row.items() if k not in self._added}  # gold: failed_output_row
                    yield beam.pvalue.TaggedOutput(FAILED_TAG, failed_record(
                        input_row, id_value=row.get(self._id_column) if self._id_column else None,
                        reason="output_type", error=f"column {name!r}: {value!r} is not {type_} ({e})",
                        stage="write"))
                    return
            out[name] = value
        for name in self._added:
            out[name] = row[name]
        if self._on_labeled is not None:
            self._on_labeled(row)
        yield out


def failed_output_row(record: dict) -> dict:
    """A failed record (`ClassifyText`'s or a read step's) -> the failed output's columns."""
    row = record.get("row")
    if isinstance(row, dict) and any(k in row for k in STASHED_KEYS):
        record = {**record, "row": {k: v for k, v in row.items() if k not in STASHED_KEYS}}
    return failed_values(record)


_ARROW_TO_BQ = [
    (pa.types.is_string, "STRING"), (pa.types.is_large_string, "STRING"), (pa.types.is_binary, "BYTES"),
    (pa.types.is_integer, "INTEGER"), (pa.types.is_floating, "FLOAT"), (pa.types.is_boolean, "BOOLEAN"),
    (lambda t: pa.types.is_timestamp(t) and t.tz is not None, "TIMESTAMP"),
    (pa.types.is_timestamp, "DATETIME"), (pa.types.is_date, "DATE"), (pa.types.is_time, "TIME"),
    (pa.types.is_decimal, "NUMERIC"),
]


def bigquery_schema(schema: pa.Schema) -> dict:
    """The BigQuery table schema for an Arrow schema (unknown types become STRING; a list
    is a REPEATED field, a struct a RECORD; a non-nullable column is REQUIRED)."""
    return {"fields": [_bigquery_field(f.name, f.type, "NULLABLE" if f.nullable else "REQUIRED") for f in schema]}


def _bigquery_field(name: str, type_: pa.DataType, mode: str = "NULLABLE") -> dict:
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return _bigquery_field(name, type_.value_type, "REPEATED")
    if pa.types.is_struct(type_):
        return {"name": name, "type": "RECORD", "mode": mode,
                "fields": [_bigquery_field(type_.field(i).name, type_.field(i).type) for i in range(type_.num_fields)]}
    return {"name": name, "type": next((bq for test, bq in _ARROW_TO_BQ if test(type_)), "STRING"), "mode": mode}


def _bigquery_value(value):
    """A value as BigQuery's JSON row format wants it."""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return value


class Destination:
    """Where one output goes: a file prefix (Parquet/JSONL) or a BigQuery table."""

    def __init__(self, *, path: str | None = None, fmt: str = "parquet", table: str | None = None):
        self.path, self.fmt, self.table = path, fmt, table

    def staged(self, staging) -> "Destination":
        """This destination with its files written under `staging` (a `publish.Staging`)."""
        if self.table:
            return self
        return Destination(path=staging.path(self.path), fmt=self.fmt)

    def describe(self) -> str:
        if self.table:
            return f"BigQuery table {self.table}"
        return f"{self.path}-*.{self.fmt}"


def destinations(options: PipelineOptions, *, default_output: str,
                 failed_name: str = "failed") -> tuple[Destination, Destination]:
    """(main output, failed) destinations from the flags (`default_output`: the prefix when
    --output is not given; `failed_name`: the failed rows' prefix beside it, unless
    --failed_output is given)."""
    o = options.view_as(StepOptions)
    output = _in_directory(o.output, _beside(default_output, "")[1]) or default_output
    if o.output_table:
        failed_table = o.failed_output_table or f"{o.output_table}_failed"
        if o.failed_output:
            return Destination(table=o.output_table), Destination(path=_in_directory(o.failed_output, failed_name),
                                                                  fmt=o.output_format)
        return Destination(table=o.output_table), Destination(table=failed_table)
    failed = _in_directory(o.failed_output, failed_name) or _beside(output, failed_name)[0]
    return Destination(path=output, fmt=o.output_format), Destination(path=failed, fmt=o.output_format)


def _beside(path: str, name: str) -> tuple[str, str]:
    """(`name` in the directory of `path`, the last part of `path`)."""
    head, sep, last = path.rpartition("/")
    return (f"{head}{sep}{name}" if sep else name), last


def _in_directory(prefix: str | None, name: str) -> str | None:
    """A prefix flag as given, or, ending in a slash (a directory), `name` inside it."""
    if prefix and prefix.endswith("/"):
        return prefix + name
    return prefix


def bigquery_write_args(options: PipelineOptions) -> dict:
    """Keyword arguments of `WriteToBigQuery` (besides the table and schema) from the flags."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    o = options.view_as(StepOptions)
    kwargs = dict(create_disposition=beam.io.BigQueryDisposition.CREATE_IF_NEEDED,
                  write_disposition=beam.io.BigQueryDisposition.WRITE_APPEND)
    if o.bigquery_write_method != "DEFAULT":
        kwargs["method"] = o.bigquery_write_method
    if o.bigquery_endpoint:  # an emulator: no GCS, temporary files stay local
        kwargs.update(validate=False, custom_gcs_temp_location=options.view_as(GoogleCloudOptions).temp_location)
    return kwargs


def write(rows, destination: Destination, schema: pa.Schema, options: PipelineOptions, *, label: str):
    """Add the write of `rows` (dicts matching `schema`) to `destination`."""
    if destination.table:
        kwargs = bigquery_write_args(options)
        return (rows | f"{label}ToBigQueryRow" >> beam.Map(lambda r: {k: _bigquery_value(v) for k, v in r.items()})
                | f"Write{label}ToBigQuery" >> beam.io.WriteToBigQuery(
                    destination.table, schema=bigquery_schema(schema), **kwargs))
    if destination.fmt == "jsonl":
        return (rows | f"{label}ToJson" >> beam.Map(to_json)
                | f"Write{label}Jsonl" >> beam.io.WriteToText(destination.path, file_name_suffix=".jsonl"))
    return rows | f"Write{label}Parquet" >> beam.io.WriteToParquet(
        destination.path, schema, file_name_suffix=".parquet")
