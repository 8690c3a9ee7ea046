"""`pipelines.classify` from a BigQuery table (or query) to BigQuery tables, against a real
BigQuery emulator on 127.0.0.1 (no mock): DIRECT_READ and EXPORT reads, STREAMING_INSERTS
and FILE_LOADS writes, worker processes, and the user's datasets surviving Beam's clean-up."""

from __future__ import annotations

import os
import typing
import uuid

import pytest

from beam_prefix import PrefixClassifier, TaskSpec
from beam_prefix.beam.classify_dofn import prob_column
from beam_prefix.model.loading import load_model
from beam_prefix.pipelines import bigquery_endpoint, classify
from beam_prefix.pipelines.options import ClassifyOptions
from beam_prefix.pipelines.sinks import bigquery_write_args

from bq_emulator import PROJECT, Emulator, executable
from conftest import TEXTS

SUPPORT = TaskSpec.from_yaml("support_tickets")
ROWS = ([{"ticket_id": f"T{i}", "text": t, "channel": i % 4} for i, t in enumerate(TEXTS[:8])]
        + [{"ticket_id": "B-null", "text": None, "channel": 1}, {"ticket_id": "B-empty", "text": "", "channel": 2}])


def test_endpoint_is_inert_until_installed():
    """Runs before the emulator fixture installs the seam."""
    from apache_beam.io.gcp import bigquery_tools

    assert bigquery_endpoint.installed() is None
    assert bigquery_tools.BigQueryWrapper._bigquery_client.__qualname__.startswith("BigQueryWrapper")
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        bigquery_endpoint.Endpoint(rest="127.0.0.1:9050")


@pytest.fixture(scope="module")
def emulator():
    exe = executable()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("bqemulator is not installed: `make test` builds it in .venv-bq")
        pytest.skip("bqemulator is not installed (`make test` builds it in .venv-bq, or set BQEMULATOR)")
    with pytest.MonkeyPatch.context() as mp:
        # No credential discovery: the GCE metadata server is an unused loopback port.
        mp.setenv("NO_GCE_CHECK", "true")
        mp.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
        mp.setenv("GCE_METADATA_IP", "127.0.0.1:9")
        em = Emulator(exe)
        try:
            yield em
        finally:
            bigquery_endpoint.uninstall()
            em.stop()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    clf = PrefixClassifier(task=SUPPORT, loaded=load_model(tiny_dir), verify=False)
    texts = [r["text"] for r in ROWS if r["text"]]
    return dict(zip(texts, clf.classify_full(texts)))


def _source_table(client) -> tuple[str, str]:
    from google.cloud import bigquery

    dataset = f"src_{uuid.uuid4().hex[:8]}"
    client.create_dataset(dataset)
    client.create_dataset(f"keep_{dataset}")  # a bystander: must survive the run
    table = bigquery.Table(f"{PROJECT}.{dataset}.tickets", schema=[
        bigquery.SchemaField("ticket_id", "STRING"), bigquery.SchemaField("text", "STRING"),
        bigquery.SchemaField("channel", "INT64")])
    client.create_table(table)
    assert client.insert_rows_json(table, ROWS) == []
    return dataset, f"{PROJECT}:{dataset}.tickets"


@pytest.mark.parametrize("source,read_method,write_method,extra", [
    ("table", "DIRECT_READ", "STREAMING_INSERTS", []),
    ("query", "DIRECT_READ", "FILE_LOADS", []),
    ("table", "EXPORT", "FILE_LOADS", []),
    ("table", "DIRECT_READ", "STREAMING_INSERTS", ["--direct_running_mode=multi_processing",
                                                   "--direct_num_workers=2"]),
])
def test_table_to_table(emulator, tiny_dir, reference, tmp_path, source, read_method, write_method, extra):
    client = emulator.client()
    dataset, table = _source_table(client)
    out = f"{PROJECT}:out_{dataset}.labeled"
    client.create_dataset(f"out_{dataset}")
    read = ([f"--input_table={table}"] if source == "table"
            else [f"--input_query=SELECT ticket_id, text, channel FROM `{PROJECT}.{dataset}.tickets`"])
    summary = classify.run([
        "--runner=DirectRunner", *extra, *read, f"--output_table={out}", f"--model={tiny_dir}",
        "--id_column=ticket_id", "--columns_to_keep=ticket_id,text,channel", "--verify=false",
        f"--project={PROJECT}", f"--temp_location={tmp_path}", f"--bigquery_read_method={read_method}",
        f"--bigquery_write_method={write_method}", f"--bigquery_endpoint={emulator.rest}",
        f"--bigquery_storage_endpoint={emulator.grpc}"])

    labeled = [dict(r) for r in client.list_rows(out.replace(":", "."))]
    failed = [dict(r) for r in client.list_rows(out.replace(":", ".") + "_failed")]
    assert len(labeled) + len(failed) == len(ROWS)
    assert (summary["rows_read"], summary["labeled"], summary["failed"]) == (len(ROWS), len(labeled), len(failed))
    assert sorted((r["id"], r["reason"], r["stage"]) for r in failed) == [
        ("B-empty", "empty_text", "validate"), ("B-null", "null_text", "validate")]
    for row in labeled:
        ref = reference[row["text"]]
        assert row["label"] == ref.label
        for name in SUPPORT.label_names:
            assert abs(row[prob_column(name)] - ref.scores[name]) <= 1e-4
    schema = {f.name: f.field_type for f in client.get_table(out.replace(":", ".")).schema}
    assert schema["channel"] == ("INTEGER" if source == "table" else "STRING")  # typed where known
    assert schema["score"] == "FLOAT" and schema["truncated"] == "BOOLEAN"

    # Beam's clean-up must not have deleted anyone's dataset (the emulator ignores label filters).
    datasets = {d.dataset_id for d in client.list_datasets()}
    assert {dataset, f"keep_{dataset}", f"out_{dataset}"} <= datasets
    assert not [d for d in datasets if d.startswith("beam_temp_dataset_")]
    assert client.get_table(f"{PROJECT}.{dataset}.tickets").num_rows == len(ROWS)


@pytest.mark.parametrize("write_method", ["FILE_LOADS", "STREAMING_INSERTS"])
def test_top_k_is_a_repeated_record(emulator, tiny_dir, reference, tmp_path, write_method):
    client = emulator.client()
    dataset, table = _source_table(client)
    out = f"{PROJECT}:out_{dataset}.labeled"
    client.create_dataset(f"out_{dataset}")
    summary = classify.run([
        "--runner=DirectRunner", f"--input_table={table}", f"--output_table={out}", f"--model={tiny_dir}",
        "--id_column=ticket_id", "--verify=false", "--top_k=2", "--prob_columns=false",
        f"--project={PROJECT}", f"--temp_location={tmp_path}", f"--bigquery_write_method={write_method}",
        f"--bigquery_endpoint={emulator.rest}", f"--bigquery_storage_endpoint={emulator.grpc}"])
    labeled = [dict(r) for r in client.list_rows(out.replace(":", "."))]
    assert summary["labeled"] == len(labeled) > 0
    field = next(f for f in client.get_table(out.replace(":", ".")).schema if f.name == "top_k")
    assert (field.field_type, field.mode) == ("RECORD", "REPEATED")
    assert [(f.name, f.field_type) for f in field.fields] == [("label", "STRING"), ("score", "FLOAT")]
    for row in labeled:
        ref = reference[row["text"]]
        assert not [c for c in row if c.startswith("prob_")]
        assert [r["label"] for r in row["top_k"]] == [n for n, _ in ref.top(2)]
        assert all(abs(r["score"] - ref.scores[r["label"]]) <= 1e-4 for r in row["top_k"])


def test_storage_write_api_is_passed_to_beam():
    """STORAGE_WRITE_API is a Java cross-language transform (its expansion jar cannot be
    fetched here), so this checks the arguments handed to WriteToBigQuery, not a write."""
    options = ClassifyOptions(["--bigquery_write_method=STORAGE_WRITE_API", "--output_table=p:d.t"])
    assert bigquery_write_args(options)["method"] == "STORAGE_WRITE_API"
    assert "method" not in bigquery_write_args(ClassifyOptions(["--output_table=p:d.t"]))



# functional form: under `from __future__ import annotations` class-syntax field types are
# strings, which Beam's schema inference reads as Any
Ticket = typing.NamedTuple("Ticket", [("ticket_id", str), ("text", str), ("channel", int)])


def test_schemad_library_output_to_bigquery(emulator, tiny_dir, reference, tmp_path):
    """ClassifyText on schema'd rows, written with the table schema derived from its output
    type (`beam_prefix.beam.schemas.bigquery_schema`): the types, the nested top_k, the labels."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from beam_prefix.beam.schemas import bigquery_row, bigquery_schema
    from beam_prefix.beam.classify_transform import ClassifyText

    client = emulator.client()
    dataset = f"lib_{uuid.uuid4().hex[:8]}"
    client.create_dataset(dataset)
    table = f"{PROJECT}:{dataset}.labeled"
    bigquery_endpoint.install(bigquery_endpoint.Endpoint(rest=emulator.rest, grpc=emulator.grpc, project=PROJECT))
    rows = [Ticket(r["ticket_id"], r["text"], r["channel"]) for r in ROWS if r["text"]]
    options = PipelineOptions([f"--project={PROJECT}", f"--temp_location={tmp_path}"])
    with beam.Pipeline(options=options) as p:
        labeled = (p | beam.Create(rows).with_output_types(Ticket)
                   | ClassifyText(task=SUPPORT, model=tiny_dir, top_k=2, verify=False)).labeled
        _ = (labeled | beam.Map(bigquery_row)
             | beam.io.WriteToBigQuery(table, schema=bigquery_schema(labeled.element_type), method="FILE_LOADS",
                                       validate=False, custom_gcs_temp_location=str(tmp_path)))
    schema = {f.name: (f.field_type, f.mode) for f in client.get_table(table.replace(":", ".")).schema}
    assert schema["channel"] == ("INTEGER", "REQUIRED") and schema["score"] == ("FLOAT", "REQUIRED")
    assert schema["top_k"] == ("RECORD", "REPEATED") and schema["truncated"] == ("BOOLEAN", "REQUIRED")
    written = [dict(r) for r in client.list_rows(table.replace(":", "."))]
    assert sorted(r["ticket_id"] for r in written) == sorted(r.ticket_id for r in rows)
    for row in written:
        assert row["label"] == reference[row["text"]].label
        assert [e["label"] for e in row["top_k"]] == [n for n, _ in reference[row["text"]].top(2)]


def test_extracted_fields_are_typed_columns(emulator, tiny_dir, tmp_path):
    """pipelines.extract to BigQuery: one typed column per task field (DATE, INTEGER, BOOLEAN...)."""
    import json

    from beam_prefix.pipelines import extract

    from test_extraction import EXAMPLES, FIELDS

    task = tmp_path / "fields.yaml"
    task.write_text(json.dumps({"kind": "extract", "fields": FIELDS, "examples": EXAMPLES, "max_new_tokens": 53}))
    client = emulator.client()
    dataset, table = _source_table(client)
    out = f"{PROJECT}:out_{dataset}.fields"
    client.create_dataset(f"out_{dataset}")
    summary = extract.run([
        "--runner=DirectRunner", f"--input_table={table}", f"--output_table={out}", f"--model={tiny_dir}",
        f"--task={task}", "--id_column=ticket_id", "--verify=false", f"--project={PROJECT}",
        f"--temp_location={tmp_path}", "--bigquery_write_method=FILE_LOADS",
        f"--bigquery_endpoint={emulator.rest}", f"--bigquery_storage_endpoint={emulator.grpc}"])
    rows = [dict(r) for r in client.list_rows(out.replace(":", "."))]
    failed = [dict(r) for r in client.list_rows(out.replace(":", ".") + "_failed")]
    assert summary["extracted"] == len(rows) > 0 and len(rows) + len(failed) == len(ROWS)
    schema = {f.name: (f.field_type, f.mode) for f in client.get_table(out.replace(":", ".")).schema}
    assert schema["since"][0] == "DATE" and schema["seats"][0] == "INTEGER" and schema["urgent"][0] == "BOOLEAN"
    assert schema["product_area"] == ("STRING", "REQUIRED") and schema["order_id"] == ("STRING", "NULLABLE")
    assert {r["product_area"] for r in rows} <= {"billing", "app", "account", "other"}
