"""`pipelines.extract` end to end on DirectRunner: Parquet in and out with the task's typed
schema, rows conserved with bad rows, the summary, and the flags it refuses."""

from __future__ import annotations

import datetime
import glob
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beam_prefix.engines.extractor import Extractor
from beam_prefix.model.loading import load_model
from beam_prefix.pipelines import extract

from conftest import TEXTS
from test_extraction import FIELDS, EXAMPLES

TASK = {"kind": "extract", "name": "tiny_fields", "instructions": "Fill in the fields.", "fields": FIELDS,
        "examples": EXAMPLES, "max_new_tokens": 53}
ROWS = ([{"ticket_id": f"T{i}", "text": t, "priority": i % 3} for i, t in enumerate(TEXTS[:8])]
        + [{"ticket_id": "B-null", "text": None, "priority": 1}, {"ticket_id": "B-empty", "text": " ", "priority": 2}])


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "tiny_fields.yaml"
    path.write_text(json.dumps(TASK))  # JSON is YAML
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny_dir, task_file):
    from beam_prefix import load_task

    ex = Extractor(task=load_task(task_file), loaded=load_model(tiny_dir), verify=False)
    texts = [r["text"] for r in ROWS if r["text"] and r["text"].strip()]
    return dict(zip(texts, ex.extract_full(texts)))


def _read(pattern) -> pa.Table:
    paths = sorted(glob.glob(pattern))
    assert paths, pattern
    return pa.concat_tables([pq.read_table(p) for p in paths])


def test_parquet_in_typed_parquet_out(tiny_dir, task_file, reference, tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    summary = extract.run(["--runner=DirectRunner", f"--input={tmp_path}/in.parquet", f"--model={tiny_dir}",
                           f"--task={task_file}", "--id_column=ticket_id", "--columns_to_keep=ticket_id,text,priority",
                           f"--output={tmp_path}/out/extracted"])
    table = _read(f"{tmp_path}/out/extracted-*.parquet")
    failed = _read(f"{tmp_path}/out/failed_extract-*.parquet").to_pylist()
    schema = table.schema
    assert schema.names[:3] == ["ticket_id", "text", "priority"] and schema.field("priority").type == pa.int64()
    assert schema.field("product_area").type == pa.string() and not schema.field("product_area").nullable
    assert schema.field("seats").type == pa.int64() and schema.field("urgent").type == pa.bool_()
    assert schema.field("since").type == pa.date32()
    finished = {t for t, e in reference.items() if e.finished}
    assert 0 < len(finished) < len(reference)
    for row in table.to_pylist():
        ref = reference[row["text"]]
        assert row["raw_output"] == ref.raw_output
        since = ref.values["since"]
        assert row["since"] == (None if since is None else datetime.date.fromisoformat(since))
        assert {k: row[k] for k in ("product_area", "order_id", "seats", "urgent")} == {
            k: ref.values[k] for k in ("product_area", "order_id", "seats", "urgent")}
    assert len(table) == len(finished)
    reasons = sorted((r["id"], r["reason"]) for r in failed)
    cut = [(r["ticket_id"], "max_new_tokens") for r in ROWS if r["text"] in reference and r["text"] not in finished]
    assert reasons == sorted(cut + [("B-empty", "empty_text"), ("B-null", "null_text")])
    assert summary["kind"] == "extract" and summary["accounted_for"]
    assert (summary["rows_read"], summary["extracted"], summary["failed"]) == (len(ROWS), len(table), len(failed))
    assert summary["generated_tokens"] == sum(e.generated_tokens for e in reference.values())
    assert json.load(open(f"{tmp_path}/out/extracted-summary.json"))["extracted"] == len(table)


def test_jsonl_out_writes_dates_as_text(tiny_dir, task_file, reference, tmp_path):
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS[:4]) + "\n")
    extract.run(["--runner=DirectRunner", f"--input={tmp_path}/in.jsonl", f"--model={tiny_dir}", f"--task={task_file}",
                 "--output_format=jsonl", f"--output={tmp_path}/out/x", "--verify=false"])
    rows = [json.loads(line) for p in glob.glob(f"{tmp_path}/out/x-*.jsonl") for line in open(p)]
    assert rows and all(r["raw_output"] == reference[r["text"]].raw_output for r in rows)


@pytest.mark.parametrize("flags,message", [
    (["--top_k=2"], "--top_k: classification flags"),
    (["--task=support_tickets"], "is a classification task"),
    (["--max_new_tokens=0"], "--max_new_tokens must be >= 1"),
])
def test_refused_flags_exit_2_before_the_model_loads(tmp_path, flags, message, capsys, monkeypatch):
    monkeypatch.setattr("beam_prefix.beam.worker.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert extract.main(["--runner=DirectRunner", f"--output={tmp_path}/out/x", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out" / "x-summary.json")
