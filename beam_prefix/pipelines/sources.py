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

import collections
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

from beam_prefix.beam.classify_dofn import FAILED_TAG, failed_record
from beam_prefix.tasks.task_file import nesting_depth
from beam_prefix.pipelines.options import SAMPLE_TICKETS, StepOptions
from beam_prefix.pipelines.paths import regular_files

__all__ = ["read_rows", "input_schema", "known_columns", "require_columns", "csv_headers", "input_format",
           "describe_input", "failed_record", "SAMPLED_LINES", "MAX_LINE_BYTES"]

_LOGGER = logging.getLogger(__name__)


def input_format(options: PipelineOptions) -> str:
    o = options.view_as(StepOptions)
    return format_of(o.input, o.input_format)


def format_of(pattern: str | None, given: str | None = None) -> str:
    """The input format: `given` (--input_format), else from `pattern`'s extension
    (.csv; .jsonl, .json, .ndjson), else parquet."""
    if given:
        return given
    lower = (pattern or "").lower()
    for ext, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".ndjson", "jsonl"), (".csv", "csv")):
        if lower.endswith(ext):
            return fmt
    return "parquet"


def describe_input(options: PipelineOptions) -> str:
    o = options.view_as(StepOptions)
    if o.input_table:
        return f"BigQuery table {o.input_table} ({o.bigquery_read_method})"
    if o.input_query:
        return f"BigQuery query ({o.bigquery_read_method})"
    if o.input:
        return f"{o.input} ({input_format(options)})"
    return f"the shipped sample tickets ({SAMPLE_TICKETS})"


# csv's default field limit (131,072 characters) is far below what Parquet and JSONL take
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


# JSON values nested deeper than this fail their line: Beam pickles rows recursively and
# overflows Python's stack a few hundred levels down, failing the whole run
MAX_ROW_DEPTH = 64
# the longest JSON Lines line a run reads (16 MiB, thousands of times any row a model's context
# holds): longer ones are refused at launch among the sampled lines, failed unparsed after them
MAX_LINE_BYTES = 16 << 20


class _ParseJsonLines(beam.DoFn):
    """One JSON object per line (read as bytes); a line that is not one becomes a failed row
    (keeping its `id_column` value where the line parsed), whatever parsing it raised. Blank
    lines are skipped, as CSV's are."""

    def __init__(self, id_column: str | None = None):
        self._id_column = id_column

    def process(self, raw: bytes):
        if len(raw) > MAX_LINE_BYTES:  # (not parsed: a 70 MB line took minutes and gigabytes)
            yield _failed({"line": raw[:1000].decode("utf-8", "backslashreplace")}, "too_long",
                          f"a JSON line of {len(raw):,} bytes: at most {MAX_LINE_BYTES:,}")
            return
        try:
            line = raw.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as e:
            yield _failed({"line": raw.decode("utf-8", "backslashreplace")}, "undecodable",
                          f"not UTF-8: byte {raw[e.start:e.end]!r} at byte {e.start} of the line")
            return
        if not line.strip():
            return
        try:
            row = json.loads(line)
        except RecursionError:
            yield _failed({"line": line[:1000]}, "unparseable", "not JSON this reader takes: nested too deeply")
            return
        except Exception as e:  # noqa: BLE001 - whatever one line raises fails that line
            yield _failed({"line": line}, "unparseable", f"not JSON: {type(e).__name__}: {e}")
            return
        if not isinstance(row, dict):
            yield _failed({"line": line}, "unparseable", "a JSON line must be an object")
            return
        if nesting_depth(row, MAX_ROW_DEPTH) > MAX_ROW_DEPTH:  # Beam's coders recurse once per level
            yield _failed({"line": line[:1000]}, "unparseable",
                          f"not JSON this reader takes: nested too deeply (at most {MAX_ROW_DEPTH} levels)")
            return
        id_value = row.get(self._id_column) if self._id_column else None
        try:  # a "\ud800" escape decodes to a lone surrogate, which no UTF-8 coder or writer takes
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            yield _failed({"line": line}, "invalid_unicode", f"not valid Unicode: {e.reason}", id_value)
            return
        except Exception as e:  # noqa: BLE001 - e.g. nested too deeply to write back out
            yield _failed({"line": line[:1000]}, "unparseable", f"{type(e).__name__}: {e}", id_value)
            return
        yield row


def _failed(row, reason: str, error: str, id_value=None):
    return beam.pvalue.TaggedOutput(FAILED_TAG, failed_record(row, id_value=id_value, reason=reason, error=error,
                                                              stage="read"))


class _ParseCsv(beam.DoFn):
    """A CSV file's rows as dicts keyed by its header; a row with the wrong number of
    fields, or with bytes that are not UTF-8, becomes a failed row (keeping its
    `id_column` value where it can be read). A header that is not UTF-8 (refused at launch
    for the files matched then) fails every row of its file."""

    def __init__(self, id_column: str | None = None):
        self._id_column = id_column

    def process(self, readable_file):
        # the whole file at once: quoted fields may hold newlines; bad bytes are kept as
        # surrogates so that one bad row does not stop the file
        name = readable_file.metadata.path
        with readable_file.open() as f:
            text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape", newline="")
            reader = csv.reader(text)
            header = None
            bad_header = False
            while True:
                try:
                    fields = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    yield _failed({"line": reader.line_num}, "unparseable", f"{name} line {reader.line_num}: {e}")
                    continue
                if header is None:
                    if not fields:  # blank lines before the header
                        continue
                    header, bad_header = fields, _has_surrogates(fields)
                    continue
                if not fields:  # a blank line
                    continue
                if bad_header:
                    yield _failed({"fields": _readable(fields)}, "undecodable",
                                  f"{name} line 1: the header has bytes that are not UTF-8")
                elif _has_surrogates(fields):
                    yield _failed({"fields": _readable(fields)}, "undecodable",
                                  f"line {reader.line_num}: bytes that are not UTF-8", self._id_of(header, fields))
                elif len(fields) != len(header):
                    yield _failed(dict(zip(header, fields)) | {"extra_fields": fields[len(header):]},
                                  "unparseable", f"line {reader.line_num}: {len(fields)} fields, the header "
                                  f"has {len(header)}", self._id_of(header, fields))
                else:
                    yield dict(zip(header, fields))

    def _id_of(self, header, fields):
        """The row's id, where its column is there and decodes."""
        if self._id_column is None or self._id_column not in header:
            return None
        i = header.index(self._id_column)
        if i >= len(fields) or _has_surrogates([fields[i]]):
            return None
        return fields[i]


def _readable(fields) -> list[str]:
    return [f.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for f in fields]


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
    o = options.view_as(StepOptions)
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
                  | "ParseCsv" >> beam.ParDo(_ParseCsv(o.id_column)).with_outputs(FAILED_TAG, main="rows"))
        return parsed.rows, parsed[FAILED_TAG]
    parsed = (p | "ReadJsonl" >> beam.io.ReadFromText(o.input, coder=coders.BytesCoder())
              | "ParseJsonl" >> beam.ParDo(_ParseJsonLines(o.id_column)).with_outputs(FAILED_TAG, main="rows"))
    return parsed.rows, parsed[FAILED_TAG]


# BigQuery standard types -> Arrow types, for a table's schema.
_BQ_TO_ARROW = {
    "STRING": pa.string(), "BYTES": pa.binary(), "INTEGER": pa.int64(), "INT64": pa.int64(),
    "FLOAT": pa.float64(), "FLOAT64": pa.float64(), "BOOLEAN": pa.bool_(), "BOOL": pa.bool_(),
    "TIMESTAMP": pa.timestamp("us", tz="UTC"), "DATE": pa.date32(), "TIME": pa.time64("us"),
    "DATETIME": pa.timestamp("us"), "NUMERIC": pa.decimal128(38, 9), "JSON": pa.string(),
}


def input_schema(options: PipelineOptions) -> pa.Schema | None:
    """The input's column types, where the source has a schema readable at launch (None for
    JSONL, a query, or CSV files that are all empty).

    Raises:
        ValueError: a CSV header that is not UTF-8 (naming the file and line).
    """
    o = options.view_as(StepOptions)
    if o.input_table:
        return _bigquery_table_schema(o.input_table, options.view_as(GoogleCloudOptions).project)
    fmt = input_format(options)
    if o.input_query or fmt == "jsonl":
        return None  # JSONL has no header: columns are known only row by row
    if not o.input:
        return pq.read_schema(SAMPLE_TICKETS)
    if fmt == "csv":  # every CSV value is a string; the header names the columns
        header = _csv_headers(o.input)
        return None if header is None else pa.schema([pa.field(name, pa.string()) for name in header])
    with FileSystems.open(_first_match(o.input)) as f:
        return pq.read_schema(f)  # reads the footer only


# JSONL columns are checked against the keys of this many first lines (a typo in a column
# flag would otherwise give an all-null column or fail every row)
SAMPLED_LINES = 1000


def known_columns(options: PipelineOptions, schema: pa.Schema | None) -> tuple[list[str] | None, str]:
    """The input's column names known at launch, and where they come from: the schema, or
    for JSONL the keys of its first `SAMPLED_LINES` lines (None: not known, e.g. a query)."""
    if schema is not None:
        return list(schema.names), "input columns"
    o = options.view_as(StepOptions)
    if o.input and input_format(options) == "jsonl":
        names, lines = _jsonl_keys(o.input, SAMPLED_LINES)
        if lines:
            return names, f"keys of the first {lines} JSONL lines"
    return None, ""


def require_columns(options: PipelineOptions, schema: pa.Schema | None, wanted: dict[str, list[str]]) -> None:
    """Refuse, at launch, flags that name columns the input lacks (`wanted`: flag -> columns)."""
    o = options.view_as(StepOptions)
    if o.input and not (o.input_table or o.input_query) and input_format(options) == "csv":
        # every matched file's header, not the first one's: a second file without the text
        # column would fail each of its rows as missing_column
        files = [(header, f"the CSV header of {path}") for path, header in csv_headers(o.input) if header]
    else:
        known, where = known_columns(options, schema)
        files = [] if known is None else [(known, where)]
    for known, where in files:
        missing = {flag: [c for c in columns if c and c not in known] for flag, columns in wanted.items()}
        missing = {flag: columns for flag, columns in missing.items() if columns}
        if missing:
            flags = "/".join(missing)
            columns = list(dict.fromkeys(c for cs in missing.values() for c in cs))
            raise ValueError(f"{flags} name columns the input lacks: {columns} ({where}: {known[:30]})")


def _first_match(pattern: str) -> str:
    """The first file `pattern` matches; a clear error when it matches none."""
    return _matches(pattern)[0]


def _matches(pattern: str) -> list[str]:
    try:
        matches = FileSystems.match([pattern])[0].metadata_list
    except Exception as e:  # noqa: BLE001 - each filesystem raises its own kind
        raise ValueError(f"--input={pattern!r} cannot be listed: {e}") from e
    if not matches:
        raise ValueError(f"--input={pattern!r} matches no file")
    return regular_files(sorted(m.path for m in matches), "--input")


def _csv_headers(pattern: str) -> list[str] | None:
    """The header of the first CSV file that has one, after checking that every matched
    file's header is UTF-8 and names each column once; None when every file is empty."""
    return next((header for _, header in csv_headers(pattern) if header), None)


def csv_headers(pattern: str) -> list[tuple[str, list[str]]]:
    """(path, header) of every CSV file `pattern` matches (an empty file: an empty header),
    each read within `MAX_HEADER_BYTES` and checked: UTF-8, each column named once.

    Raises:
        ValueError: naming the file whose header is refused.
    """
    found = []
    for path in _matches(pattern):
        with FileSystems.open(path) as f:
            header = _csv_header(f, path)
        if header and _has_surrogates(header):
            bad = next(h for h in header if _has_surrogates([h]))
            raise ValueError(f"--input: {path} line 1 (the CSV header) has bytes that are not UTF-8, in column "
                             f"{_readable([bad])[0]!r}; re-encode the file as UTF-8")
        twice = sorted(h for h, n in collections.Counter(header).items() if n > 1)  # (a 1 MB header: linear)
        if twice:  # a row's dict would keep only the last column of the name
            raise ValueError(f"--input: {path}: the CSV header names column(s) {_readable(twice)} more than once; "
                             f"give each column its own name")
        found.append((path, header))
    return found


# a CSV header is read at launch from at most this many bytes (a file with no line break,
# e.g. a device, would otherwise be read without end)
MAX_HEADER_BYTES = 1 << 20


def _csv_header(f, path: str) -> list[str]:
    raw = f.read(MAX_HEADER_BYTES + 1)
    text = raw.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    lines = text.splitlines(keepends=True)
    if len(raw) > MAX_HEADER_BYTES and not any(line.strip("\r\n") for line in lines[:-1]):
        raise ValueError(f"--input: {path}: no CSV header line within its first {MAX_HEADER_BYTES:,} bytes")
    try:
        return next((fields for fields in csv.reader(io.StringIO(text, newline="")) if fields), [])
    except csv.Error:
        return []


MAX_SAMPLED_BYTES = 64 << 20  # what the JSONL key sample reads at most, all files together


def _jsonl_keys(pattern: str, limit: int) -> tuple[list[str], int]:
    """Keys of the JSON objects in the first `limit` non-blank lines of the matched files, in
    first-seen order, and how many lines were read (lines that do not parse are skipped:
    they fail as rows).

    Raises:
        ValueError: a sampled line longer than `MAX_LINE_BYTES` (naming the file and line):
            no row is that long, and reading it would take the run minutes and gigabytes.
    """
    keys: dict[str, None] = {}
    lines, budget = 0, MAX_SAMPLED_BYTES
    for path in _matches(pattern):
        with FileSystems.open(path) as f:
            number = 0
            # (bounded: a file with no line break is not read to its end)
            while raw := f.readline(min(budget, MAX_LINE_BYTES + 1)):
                number += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise ValueError(f"--input: {path} line {number} is longer than {MAX_LINE_BYTES:,} bytes, the "
                                     f"most a JSON Lines row may hold; split or drop it")
                budget -= len(raw)
                if budget <= 0:
                    return list(keys), lines
                if not raw.strip():
                    continue
                lines += 1
                try:
                    row = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
                except Exception:  # noqa: BLE001 - a bad line fails as a row at run time
                    row = None
                if isinstance(row, dict):
                    keys.update(dict.fromkeys(k for k in row if isinstance(k, str)))
                if lines >= limit:
                    return list(keys), lines
    return list(keys), lines


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
