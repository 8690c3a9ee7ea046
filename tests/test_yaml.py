"""Beam YAML: the shipped example pipeline through `apache_beam.yaml.main`, on the tiny model."""

from __future__ import annotations

import json
import os

from apache_beam.yaml import main as yaml_main

from beam_prefix import PrefixClassifier
from beam_prefix.model.loading import load_model
from beam_prefix.tasks.task import TaskSpec

from test_beam import _read_jsonl

ROOT = os.path.join(os.path.dirname(__file__), "..")
PIPELINE = os.path.join(ROOT, "pipelines", "yaml", "classify_tickets.yaml")
TASK = os.path.join(ROOT, "pipelines", "tasks", "support_tickets.yaml")


def test_yaml_pipeline_classifies_and_routes_errors(tiny_dir, tmp_path):
    """The shipped pipeline with a shipped task by its name (a path works the same)."""
    tickets = tmp_path / "tickets.csv"
    tickets.write_text("ticket_id,text,label\nT1,I was charged twice,billing\nT2,The app crashes,technical\n"
                       "T3,,account\nT4,please delete my account,account\n", encoding="utf-8")
    out = tmp_path / "out"
    yaml_main.run(argv=[
        f"--yaml_pipeline_file={PIPELINE}", "--runner=DirectRunner",
        "--jinja_variables=" + json.dumps({"input": str(tickets), "output": str(out), "task": "support_tickets",
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
    from beam_prefix.engines.extractor import Extractor

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


def _chain_run(tiny_dir, tmp_path, fields_task, rows):
    tickets = tmp_path / "tickets.csv"
    tickets.write_text("ticket_id,text,label\n" + "".join(f"{r[0]},{r[1]},{r[2]}\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out"
    yaml_main.run(argv=[
        f"--yaml_pipeline_file={os.path.join(ROOT, 'pipelines', 'yaml', 'classify_then_extract.yaml')}",
        "--runner=DirectRunner",
        "--jinja_variables=" + json.dumps({"input": str(tickets), "output": str(out), "classify_task": TASK,
                                           "extract_task": str(fields_task), "model": tiny_dir})])
    return out


def test_yaml_chain_classify_then_extract_with_top_k(tiny_dir, tmp_path):
    """The shipped chain-form example: ClassifyText (top_k) then ExtractFields on its
    labelled rows, no extra arguments; each step's metadata columns are its own."""
    from beam_prefix import load_task
    from beam_prefix.engines.extractor import Extractor

    from test_extraction import FIELDS

    fields_task = tmp_path / "fields.yaml"
    fields_task.write_text(json.dumps({"kind": "extract", "instructions": "Fill in the fields.", "fields": FIELDS,
                                       "max_new_tokens": 80, "version": "f1"}))
    out = _chain_run(tiny_dir, tmp_path, fields_task, [("T1", "I was charged twice", "billing"),
                                                       ("T2", "The app crashes", "technical"), ("T3", "", "account")])
    rows = {r["ticket_id"]: r for r in _read_jsonl(f"{out}/routed_fields.json*")}
    classify_errors = _read_jsonl(f"{out}/classify_errors.json*")
    assert sorted(rows) == ["T1", "T2"] and [e["element"]["ticket_id"] for e in classify_errors] == ["T3"]
    assert _read_jsonl(f"{out}/extract_errors.json*") == []
    clf = PrefixClassifier(task=TaskSpec.from_yaml(TASK), loaded=load_model(tiny_dir), verify=False)
    ex = Extractor(task=load_task(fields_task), loaded=load_model(tiny_dir), verify=False)
    texts = {"T1": "I was charged twice", "T2": "The app crashes"}
    labels = dict(zip(texts, clf.classify_full(list(texts.values()))))
    fields = dict(zip(texts, ex.extract_full(list(texts.values()))))
    for key, row in rows.items():
        assert row["label"] == labels[key].label and row["gold"]
        assert [e["label"] for e in row["top_k"]] == [n for n, _ in labels[key].top(2)]
        assert row["raw_output"] == fields[key].raw_output
        # the classifier's metadata kept as it was, the extractor's beside it under its prefix
        assert row["prompt_fingerprint"] == clf.fingerprint and row["extract_prompt_fingerprint"] == ex.fingerprint
        assert row["model"] == row["extract_model"] == clf.model_id
        assert row["extract_task_version"] == "f1" and "task_version" not in row
        assert row["truncated"] is False and row["extract_truncated"] is False


def _csv(path, rows):
    path.write_text("ticket_id,text,label\n" + "".join(f"{i},{t},{g}\n" for i, t, g in rows), encoding="utf-8")
    return str(path)


def test_yaml_classes_take_every_keyword_of_the_python_transforms():
    """Parity by construction, checked: each YAML transform's config fields (what Beam YAML
    reads from its constructor) are the Python transform's keywords plus error_handling."""
    import inspect

    from beam_prefix import yaml_provider
    from beam_prefix.beam import classify_transform, embed_transform, extract_transform
    from apache_beam.yaml.yaml_provider import InlineProvider

    for yaml_cls, python_cls in ((yaml_provider.ClassifyText, classify_transform.ClassifyText),
                                 (yaml_provider.ExtractFields, extract_transform.ExtractFields),
                                 (yaml_provider.EmbedText, embed_transform.EmbedText)):
        python = {n: p.default for n, p in inspect.signature(python_cls.__init__).parameters.items()
                  if n not in ("self", "label")}
        fields = [f.name for f in InlineProvider.config_schema_from_callable(yaml_cls).fields]
        assert sorted(fields) == sorted([*python, "error_handling"]), yaml_cls.__name__
        for name in ("threads", "min_batch_size", "max_batch_size", "keep_columns", "device"):
            assert name in fields
    assert {"output_features", "tasks", "task_column", "label_tolerance"} <= set(
        inspect.signature(yaml_provider.ClassifyText.__init__).parameters)


def test_yaml_embed_example_gives_the_engines_features(tiny_dir, tmp_path):
    """pipelines/yaml/embed_tickets.yaml (EmbedText: layers, mean pooling, threads, batch
    sizes) through apache_beam.yaml.main: each row's features are the engine's own."""
    texts = {"T1": "I was charged twice", "T2": "The app crashes", "T4": "please delete my account"}
    tickets = _csv(tmp_path / "t.csv", [(k, v, "x") for k, v in texts.items()] + [("T3", "", "x")])
    out = tmp_path / "out"
    yaml_main.run(argv=[
        f"--yaml_pipeline_file={os.path.join(ROOT, 'pipelines', 'yaml', 'embed_tickets.yaml')}",
        "--runner=DirectRunner", "--jinja_variables=" + json.dumps(
            {"input": tickets, "output": str(out), "task": TASK, "model": tiny_dir, "layers": [1, -1]})])
    rows = {r["ticket_id"]: r for r in _read_jsonl(f"{out}/features.json*")}
    errors = _read_jsonl(f"{out}/embed_errors.json*")
    assert sorted(rows) == ["T1", "T2", "T4"] and [e["element"]["ticket_id"] for e in errors] == ["T3"]
    clf = PrefixClassifier(task=TaskSpec.from_yaml(TASK), loaded=load_model(tiny_dir), verify=False)
    full = dict(zip(texts, clf.embed_full(list(texts.values()), layers=[1, -1], pooling="mean")))
    for key, row in rows.items():
        assert sorted(row) == ["features", "model", "prompt_fingerprint", "ticket_id", "truncated"]
        assert max(abs(a - b) for a, b in zip(row["features"], full[key].features)) < 1e-4


def test_yaml_routed_example_classifies_each_row_with_its_task(tiny_dir, tmp_path):
    """pipelines/yaml/classify_routed.yaml: tasks + task_column, label_tolerance,
    output_features, threads and batch sizes from YAML; each row gets its queue's task."""
    support, banking = tmp_path / "support.yaml", tmp_path / "banking.yaml"
    for path, labels in ((support, ["billing", "technical", "account"]),
                         (banking, ["card_lost", "card_arrival", "top_up_failed", "refund"])):
        path.write_text(json.dumps({"name": path.stem, "instructions": "Pick the label of the message.",
                                    "labels": labels, "calibration": False}))
    texts = {"T1": "my card never arrived", "T2": "The app crashes", "T3": "a charge I do not know"}
    tickets = _csv(tmp_path / "t.csv", [(k, v, "x") for k, v in texts.items()])
    out = tmp_path / "out"
    yaml_main.run(argv=[
        f"--yaml_pipeline_file={os.path.join(ROOT, 'pipelines', 'yaml', 'classify_routed.yaml')}",
        "--runner=DirectRunner", "--jinja_variables=" + json.dumps(
            {"input": tickets, "output": str(out), "support_task": str(support), "banking_task": str(banking),
             "model": tiny_dir})])
    rows = {r["ticket_id"]: r for r in _read_jsonl(f"{out}/routed_labeled.json*")}
    assert sorted(rows) == ["T1", "T2", "T3"] and _read_jsonl(f"{out}/routed_errors.json*") == []
    assert {k: r["task"] for k, r in rows.items()} == {"T1": "banking", "T2": "support", "T3": "banking"}
    loaded = load_model(tiny_dir)
    for key, row in rows.items():
        spec = TaskSpec.from_yaml(str(banking if row["task"] == "banking" else support)).replace(label_tolerance=0.001)
        ref = PrefixClassifier(task=spec, loaded=loaded, verify=False).classify_full([texts[key]])[0]
        # pruned label search: within its label_tolerance (1e-3) of exhaustive scoring
        assert row["label"] == ref.label and abs(row["score"] - ref.score) < 1e-4 + 1e-3
        assert isinstance(row["features"], list) and len(row["features"]) > 0
