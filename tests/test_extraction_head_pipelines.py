"""Extraction heads through the pipelines: `pipelines.fit` fits one from labelled JSONL,
`pipelines.extract` and `ExtractFields` answer with it, outputs equal to the engine's
no-cache reference, every row in exactly one output."""

from __future__ import annotations

import csv
import glob
import json

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.yaml import main as yaml_main

from beam_prefix import load_task
from beam_prefix.beam import ExtractFields
from beam_prefix.engines.extractor import Extractor
from beam_prefix.model.loading import load_model
from beam_prefix.pipelines import extract, fit

from conftest import ROOT
from test_extraction_head import FIELDS, ticket_rows

TASK = {"kind": "extract", "name": "tickets", "instructions": "Fill in the ticket's fields.", "fields": FIELDS,
        "suffix_template": "Ticket: {text}"}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, tiny_dir):
    """(task file with scoring: head, the fit's summary): a head fit by pipelines.fit."""
    folder = tmp_path_factory.mktemp("extraction_head")
    (folder / "plain.yaml").write_text(json.dumps(TASK))
    with open(folder / "train.jsonl", "w") as f:
        for row in ticket_rows(40):
            f.write(json.dumps(row) + "\n")
    summary = fit.run(["--runner=DirectRunner", f"--task={folder}/plain.yaml", f"--input={folder}/train.jsonl",
                       f"--model={tiny_dir}", f"--output={folder}/tickets.head", "--folds=2"])
    (folder / "tickets.yaml").write_text(json.dumps({**TASK, "scoring": "head", "head": "tickets.head"}))
    return str(folder / "tickets.yaml"), summary


def test_fit_writes_an_extraction_head_with_what_the_folds_chose(fitted):
    task_file, summary = fitted
    task = load_task(task_file)
    assert summary["kind"] == "extract" and summary["rows_used"] == 40
    assert summary["tagger"]["layers"] == list(task.head.tagger.layers)
    assert set(summary["fields"]) == {"area", "refund"}
    assert "span F1" in fit._format(summary)


def test_extract_answers_with_the_head(fitted, tiny_dir, tmp_path):
    task_file, _ = fitted
    rows = [{"id": f"r{i}", "text": r["text"]} for i, r in enumerate(ticket_rows(8, seed=3))]
    rows += [{"id": "bad", "text": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    summary = extract.run(["--runner=DirectRunner", f"--input={tmp_path}/in.parquet", f"--model={tiny_dir}",
                           f"--task={task_file}", "--id_column=id", f"--output={tmp_path}/out/fields"])
    out = pa.concat_tables([pq.read_table(p) for p in sorted(glob.glob(f"{tmp_path}/out/fields-*.parquet"))]).to_pylist()
    failed = pa.concat_tables([pq.read_table(p) for p in
                               sorted(glob.glob(f"{tmp_path}/out/failed_extract-*.parquet"))]).to_pylist()
    assert sorted(r["id"] for r in out) == [f"r{i}" for i in range(8)] and [r["id"] for r in failed] == ["bad"]
    ex = Extractor(task=load_task(task_file), loaded=load_model(tiny_dir), verify=False)
    reference = {r["text"]: e.values for r, e in zip(rows[:8], ex.extract_full([r["text"] for r in rows[:8]]))}
    for r in out:
        assert {f["name"]: r[f["name"]] for f in FIELDS} == reference[r["text"]]
        assert json.loads(r["raw_output"])["spans"].get("order_id") == r["order_id"]
    assert summary["rows_read"] == 9 and summary["failed"] == 1


def test_extract_fields_in_a_pipeline_uses_the_head(fitted, tiny_dir):
    task_file, _ = fitted
    texts = [r["text"] for r in ticket_rows(5, seed=4)]
    ex = Extractor(task=load_task(task_file), loaded=load_model(tiny_dir), verify=False)
    expected = [(t, e.values["order_id"], e.values["area"]) for t, e in zip(texts, ex.extract_full(texts))]
    with TestPipeline() as p:
        result = (p | beam.Create([{"text": t} for t in texts])
                  | ExtractFields(task=task_file, model=tiny_dir, verify=True))
        assert_that(result.extracted | beam.Map(lambda r: (r["text"], r["order_id"], r["area"])), equal_to(expected))
        assert_that(result.failed, equal_to([]), label="no failures")


@pytest.mark.parametrize("flag", ["--label_column=label", "--layers=-1", "--pooling=mean", "--prefer=cost",
                                  "--label_rows=true"])
def test_fit_refuses_classification_flags_for_an_extraction_task(fitted, tmp_path, flag, capsys):
    task_file, _ = fitted
    status = fit.main(["--runner=DirectRunner", f"--task={task_file}", f"--input={tmp_path}/x.jsonl",
                       f"--output={tmp_path}/x.head", flag])
    assert status == 2
    assert "is for a classification head" in capsys.readouterr().err


def test_the_beam_yaml_extraction_pipeline_runs_a_head_task(fitted, tiny_dir, tmp_path):
    task_file, _ = fitted
    texts = [r["text"] for r in ticket_rows(3, seed=5)]
    with open(tmp_path / "tickets.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("ticket_id", "text"), *((f"T{i}", t) for i, t in enumerate(texts))])
    out = tmp_path / "out"
    yaml_main.run(argv=[
        f"--yaml_pipeline_file={ROOT / 'pipelines' / 'yaml' / 'extract_ticket_fields.yaml'}",
        "--runner=DirectRunner",
        "--jinja_variables=" + json.dumps({"input": str(tmp_path / "tickets.csv"), "output": str(out),
                                           "task": task_file, "model": tiny_dir})])
    rows = [json.loads(line) for p in sorted(glob.glob(f"{out}/extracted.json*")) for line in open(p)]
    ex = Extractor(task=load_task(task_file), loaded=load_model(tiny_dir), verify=False)
    reference = {t: e for t, e in zip(texts, ex.extract_full(texts))}
    assert sorted(r["ticket_id"] for r in rows) == ["T0", "T1", "T2"]
    for r in rows:
        assert r["raw_output"] == reference[r["text"]].raw_output and r["area"] == reference[r["text"]].values["area"]


def test_run_inference_extracts_with_the_head_and_bad_texts_fail_alone(fitted, tiny_dir):
    from apache_beam.ml.inference.base import RunInference

    from beam_prefix.handler import KeyedPrefixCachedModelHandler, PrefixCachedModelHandler

    task_file, _ = fitted
    texts = [r["text"] for r in ticket_rows(6, seed=6)]
    ex = Extractor(task=load_task(task_file), loaded=load_model(tiny_dir), verify=False)
    expected = [(t, json.dumps(e.values, sort_keys=True)) for t, e in zip(texts, ex.extract_full(texts))]
    with TestPipeline() as p:
        main, dlq = (p | beam.Create(texts + [None])
                     | RunInference(PrefixCachedModelHandler(task=task_file, model=tiny_dir, batch_size=4))
                     .with_exception_handling())
        assert_that(main | beam.Map(lambda r: (r.example, json.dumps(r.inference.values, sort_keys=True))),
                    equal_to(expected), label="head answers")
        assert_that(dlq.failed_preprocessing[0] | beam.Map(lambda e: e[1][0].__name__), equal_to(["RowError"]),
                    label="bad text alone")
        keyed = (p | "keyed" >> beam.Create([(f"k{i}", t) for i, t in enumerate(texts)])
                 | "keyed RI" >> RunInference(KeyedPrefixCachedModelHandler(task=task_file, model=tiny_dir))
                 | beam.MapTuple(lambda k, r: (r.example, json.dumps(r.inference.values, sort_keys=True))))
        assert_that(keyed, equal_to(expected), label="keyed")


def test_run_inference_refuses_a_classification_suffix_pass_for_extraction(fitted):
    from beam_prefix.handler import PrefixCachedModelHandler

    with pytest.raises(ValueError, match="for classification tasks"):
        PrefixCachedModelHandler(task=fitted[0], suffix_pass="buckets")
