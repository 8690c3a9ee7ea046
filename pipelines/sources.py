"""Reading input rows: Parquet, JSONL, CSV files, BigQuery, or the shipped sample.

`read_rows(p, options)` returns the rows (dicts) and the rows that could not even be
parsed (a bad JSON line, a CSV row with the wrong number of fields, a line that is not
UTF-8), already shaped as failed records, so that every input row is accounted for. A
UTF-8 byte-order mark is dropped, and a CSV field may be as long as a Parquet or JSONL
text (Python's csv module stops at 131,072 characters by default).
`input_schema(options)` reads the input's column types at launch where the source has a
schema (Parquet, a BigQuery table), so outputs keep those types.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam import coders
from apache_beam.io import fileio
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

from beam_prefix.dofn import FAILED_TAG, failed_record
from pipelines.options import SAMPLE_TICKETS, ClassifyOptions

__all__ = ["read_rows", "input_schema", "input_format", "describe_input", "failed_record"]

_LOGGER = logging.getLogger(__name__)


def input_format(options: PipelineOptions) -> str:
    o = options.view_as(ClassifyOptions)
    if o.input_format:
        return o.input_format
    pattern = (o.input or "").lower()
    for ext, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".ndjson", "jsonl"), (".csv", "csv")):
        if pattern.endswith(ext):
            return fmt
    return "parquet"


def describe_input(options: PipelineOptions) -> str:
    o = options.view_as(ClassifyOptions)
    if o.input_table:
        return f"BigQuery table {o.input_table} ({o.bigquery_read_method})"
    if o.input_query:
        return f"BigQuery query ({o.bigquery_read_method})"
    if o.input:
        return f"{o.input} ({input_format(options)})"
    return f"the shipped sample tickets ({SAMPLE_TICKETS})"


# csv's default field limit (131,072 characters) is far below what Parquet and JSONL take
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


class _ParseJsonLines(beam.DoFn):
    """One JSON object per line (read as bytes); a line that is not one becomes a failed row."""

    def process(self, raw: bytes):
        try:
            line = raw.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as e:
            yield beam.pvalue.TaggedOutput(FAILED_TAG, failed_record(
                {"line": raw.decode("utf-8", "backslashreplace")}, reason="undecodable",
                error=f"not UTF-8: byte {raw[e.start:e.end]!r} at byte {e.start} of the line", stage="read"))
            return
        try:
            row = json.loads(line)
        except ValueError as e:
            yield beam.pvalue.TaggedOutput(FAILED_TAG, failed_record(
                {"line": line}, reason="unparseable", error=f"not JSON: {e}", stage="read"))
            return
        if not isinstance(row, dict):
            yield beam.pvalue.TaggedOutput(FAILED_TAG, failed_record(
                {"line": line}, reason="unparseable", error="a JSON line must be an object", stage="read"))
            return
        try:  # a "\ud800" escape decodes to a lone surrogate, which no UTF-8 coder or writer takes
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            yield beam.pvalue.TaggedOutput(FAILED_TAG, failed_record(
                {"line": line}, reason="invalid_unicode", error=f"not valid Unicode: {e.reason}", stage="read"))
            return
        yield row


class _ParseCsv(beam.DoFn):
    """A CSV file's rows as dicts keyed by its header; a row with the wrong number of
    fields, or with bytes that are not UTF-8, becomes a failed row."""

    def process(self, readable_file):
        # the whole file at once: quoted fields may hold newlines; bad bytes are kept as
        # surrogates so that one bad row does not stop the file
        with readable_file.open() as f:
            text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape", newline="")
            reader = csv.reader(text)
            header = None
            while True:
                try:
                    fields = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    yield self._failed({"line": reader.line_num}, "unparseable", f"line {reader.line_num}: {e}")
                    continue
                if header is None:
                    header = fields
                    continue
                if not fields:  # a blank line
                    continue
                if _has_surrogates(fields):
                    yield self._failed({"fields": [f.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                                                   for f in fields]}, "undecodable",
                                       f"line {reader.line_num}: bytes that are not UTF-8")
                elif len(fields) != len(header):
                    yield self._failed(dict(zip(header, fields)) | {"extra_fields": fields[len(header):]},
                                       "unparseable", f"line {reader.line_num}: {len(fields)} fields, the header "
                                       f"has {len(header)}")
                else:
                    yield dict(zip(header, fields))

    @staticmethod
    def _failed(row, reason: str, error: str):
        return beam.pvalue.TaggedOutput(FAILED_TAG, failed_record(row, reason=reason, error=error, stage="read"))


def _has_surrogates(fields) -> bool:
    try:
        "".join(fields).encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def read_rows(p, options: PipelineOptions):
    """Add the read steps to `p`.

    Returns:
        (rows, unparseable): PCollections of dict rows and of failed records.
    """
    o = options.view_as(ClassifyOptions)
    none = p | "NoUnparseableRows" >> beam.Create([])
    if o.input_table or o.input_query:
        gcs_location = None
        if o.bigquery_read_method == "EXPORT":
            gcs_location = options.view_as(GoogleCloudOptions).temp_location
        rows = p | "ReadBigQuery" >> beam.io.ReadFromBigQuery(
            table=o.input_table, query=o.input_query, use_standard_sql=True,
            method=o.bigquery_read_method, gcs_location=gcs_location,
            project=options.view_as(GoogleCloudOptions).project)
        return rows, none
    if not o.input:
        # Read here, not on workers: the package's files sit at a path workers may not share.
        return p | "SampleTickets" >> beam.Create(pq.read_table(SAMPLE_TICKETS).to_pylist()), none
    fmt = input_format(options)
    _first_match(o.input)  # every kind fails the same clear way, at launch, when nothing matches
    if fmt == "parquet":
        return p | "ReadParquet" >> beam.io.ReadFromParquet(o.input), none
    if fmt == "csv":
        parsed = (p | "MatchCsv" >> fileio.MatchFiles(o.input) | "OpenCsv" >> fileio.ReadMatches()
                  | "ParseCsv" >> beam.ParDo(_ParseCsv()).with_outputs(FAILED_TAG, main="rows"))
        return parsed.rows, parsed[FAILED_TAG]
    parsed = (p | "ReadJsonl" >> beam.io.ReadFromText(o.input, coder=coders.BytesCoder())
              | "ParseJsonl" >> beam.ParDo(_ParseJsonLines()).with_outputs(FAILED_TAG, main="rows"))
    return parsed.rows, parsed[FAILED_TAG]


# BigQuery standard types -> Arrow types, for a table's schema.
_BQ_TO_ARROW = {
    "STRING": pa.string(), "BYTES": pa.binary(), "INTEGER": pa.int64(), "INT64": pa.int64(),
    "FLOAT": pa.float64(), "FLOAT64": pa.float64(), "BOOLEAN": pa.bool_(), "BOOL": pa.bool_(),
    "TIMESTAMP": pa.timestamp("us", tz="UTC"), "DATE": pa.date32(), "TIME": pa.time64("us"),
    "DATETIME": pa.timestamp("us"), "NUMERIC": pa.decimal128(38, 9), "JSON": pa.string(),
}


def input_schema(options: PipelineOptions) -> pa.Schema | None:
    """The input's column types, where the source has a schema readable at launch."""
    o = options.view_as(ClassifyOptions)
    if o.input_table:
        return _bigquery_table_schema(o.input_table, options.view_as(GoogleCloudOptions).project)
    fmt = input_format(options)
    if o.input_query or fmt == "jsonl":
        return None  # JSONL has no header: columns are known only row by row
    if not o.input:
        return pq.read_schema(SAMPLE_TICKETS)
    with FileSystems.open(_first_match(o.input)) as f:
        if fmt == "csv":  # every CSV value is a string; the header names the columns
            return pa.schema([pa.field(name, pa.string()) for name in _csv_header(f)])
        return pq.read_schema(f)  # reads the footer only


def _first_match(pattern: str) -> str:
    """The first file `pattern` matches; a clear error when it matches none."""
    try:
        matches = FileSystems.match([pattern])[0].metadata_list
    except Exception as e:  # noqa: BLE001 - each filesystem raises its own kind
        raise ValueError(f"--input={pattern!r} cannot be listed: {e}") from e
    if not matches:
        raise ValueError(f"--input={pattern!r} matches no file")
    return sorted(m.path for m in matches)[0]


def _csv_header(f) -> list[str]:
    text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape", newline="")
    try:
        header = next(csv.reader(text), [])
    except csv.Error:
        header = []
    text.detach()
    return [name.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for name in header]


def _bigquery_table_schema(table: str, project: str | None) -> pa.Schema | None:
    from apache_beam.io.gcp import bigquery_tools

    ref = bigquery_tools.parse_table_reference(table, project=project)
    wrapper = bigquery_tools.BigQueryWrapper()
    fields = wrapper.get_table(ref.projectId, ref.datasetId, ref.tableId).schema.fields
    columns = []
    for field in fields:
        if field.mode == "REPEATED" or field.type in ("RECORD", "STRUCT"):
            columns.append(pa.field(field.name, pa.string()))  # kept as JSON text
        else:
            columns.append(pa.field(field.name, _BQ_TO_ARROW.get(field.type, pa.string())))
    return pa.schema(columns)
