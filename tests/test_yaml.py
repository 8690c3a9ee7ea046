"""Beam YAML: the shipped example pipeline through `apache_beam.yaml.main`, on the tiny model."""

from __future__ import annotations

import json
import os

from apache_beam.yaml import main as yaml_main

from beam_prefix import PrefixClassifier
from beam_prefix.model import load_model
from beam_prefix.task import TaskSpec

from test_beam import _read_jsonl

ROOT = os.path.join(os.path.dirname(__file__), "..")
PIPELINE = os.path.join(ROOT, "pipelines", "yaml", "classify_tickets.yaml")
TASK = os.path.join(ROOT, "pipelines", "tasks", "support_tickets.yaml")


def test_yaml_pipeline_classifies_and_routes_errors(tiny_dir, tmp_path):
    tickets = tmp_path / "tickets.csv"
    tickets.write_text("ticket_id,text,label\nT1,I was charged twice,billing\nT2,The app crashes,technical\n"
                       "T3,,account\nT4,please delete my account,account\n", encoding="utf-8")
    out = tmp_path / "out"
    yaml_main.run(argv=[
        f"--yaml_pipeline_file={PIPELINE}", "--runner=DirectRunner",
        "--jinja_variables=" + json.dumps({"input": str(tickets), "output": str(out), "task": TASK,
                                           "model": tiny_dir})])
    labeled = {r["ticket_id"]: r for r in _read_jsonl(f"{out}/labeled.json*")}
    errors = _read_jsonl(f"{out}/errors.json*")
    texts = {"T1": "I was charged twice", "T2": "The app crashes", "T4": "please delete my account"}
    clf = PrefixClassifier(task=TaskSpec.from_yaml(TASK), loaded=load_model(tiny_dir), verify=False)
    reference = dict(zip(texts, clf.classify_full(list(texts.values()))))
    assert sorted(labeled) == ["T1", "T2", "T4"]
    for key, row in labeled.items():
        assert row["label"] == reference[key].label and abs(row["score"] - reference[key].score) < 1e-4
        assert row["gold"] and row["prompt_fingerprint"]
    assert len(errors) == 1 and errors[0]["element"]["ticket_id"] == "T3"
    assert errors[0]["msg"].startswith(("null_text", "empty_text")) and errors[0]["stack"] == "validate"


def test_yaml_extraction_pipeline_extracts_and_routes_errors(tiny_dir, tmp_path):
    from beam_prefix import load_task
    from beam_prefix.extractor import Extractor

    from test_extraction import FIELDS

    task = tmp_path / "fields.yaml"
    # 80 new tokens: the tiny Llama closes the objects of both texts
    task.write_text(json.dumps({"kind": "extract", "instructions": "Fill in the fields.", "fields": FIELDS,
                                "max_new_tokens": 80}))
    tickets = tmp_path / "tickets.csv"
    tickets.write_text("ticket_id,text\nT1,I was charged twice\nT2,The app crashes\nT3,\n", encoding="utf-8")
    out = tmp_path / "out"
    yaml_main.run(argv=[
        f"--yaml_pipeline_file={os.path.join(ROOT, 'pipelines', 'yaml', 'extract_ticket_fields.yaml')}",
        "--runner=DirectRunner",
        "--jinja_variables=" + json.dumps({"input": str(tickets), "output": str(out), "task": str(task),
                                           "model": tiny_dir})])
    extracted = {r["ticket_id"]: r for r in _read_jsonl(f"{out}/extracted.json*")}
    errors = _read_jsonl(f"{out}/errors.json*")
    ex = Extractor(task=load_task(task), loaded=load_model(tiny_dir), verify=False)
    reference = dict(zip(("T1", "T2"), ex.extract_full(["I was charged twice", "The app crashes"])))
    assert sorted(extracted) == ["T1", "T2"] and all(r.finished for r in reference.values())
    for key, row in extracted.items():
        assert row["raw_output"] == reference[key].raw_output
        assert row["product_area"] == reference[key].values["product_area"]
    assert len(errors) == 1 and errors[0]["element"]["ticket_id"] == "T3" and errors[0]["stack"] == "validate"
