"""`pipelines.classify` end to end on DirectRunner: Parquet, JSONL and CSV in, Parquet and
JSONL out, row conservation, output schema, the embedded no-argument run, and outputs
that are complete or absent when a run fails."""

from __future__ import annotations

import glob
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beam_prefix import PrefixClassifier, TaskSpec
from beam_prefix.beam.classify_dofn import prob_column
from beam_prefix.model.loading import load_model
from beam_prefix.pipelines import classify
from beam_prefix.pipelines.options import SAMPLE_TICKETS
from beam_prefix.pipelines.sinks import ToOutputRow

from conftest import TEXTS

SUPPORT = TaskSpec.from_yaml("support_tickets")
LONG_TEXT = ("The export page hangs. " * 900)[:20_000]


def _reference(model_dir, texts):
    clf = PrefixClassifier(task=SUPPORT, loaded=load_model(model_dir), verify=False)
    return {t: p for t, p in zip(texts, clf.classify_full(texts))}


def _read_parquet(pattern) -> pa.Table:
    paths = sorted(glob.glob(pattern))
    assert paths, f"no files match {pattern}"
    return pa.concat_tables([pq.read_table(p) for p in paths])


def _write_inputs(directory):
    """Two Parquet files: good rows and bad ones (null, empty, 20,000 characters), and one
    whose text column holds integers (a wrong type)."""
    good = [{"ticket_id": f"T{i}", "text": t, "priority": i % 3} for i, t in enumerate(TEXTS)]
    bad = [{"ticket_id": "B-null", "text": None, "priority": 1},
           {"ticket_id": "B-empty", "text": "   ", "priority": 1},
           {"ticket_id": "B-long", "text": LONG_TEXT, "priority": 2}]
    pq.write_table(pa.Table.from_pylist(good + bad), os.path.join(directory, "tickets-a.parquet"))
    pq.write_table(pa.Table.from_pylist([{"ticket_id": "B-int", "text": 12345, "priority": 0}]),
                   os.path.join(directory, "tickets-b.parquet"))
    return good, bad


def test_parquet_in_parquet_out_equals_full_reencoding(tiny_dir, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    good, bad = _write_inputs(inputs)
    out = tmp_path / "out"
    summary = classify.run([
        "--runner=DirectRunner", f"--input={inputs}/*.parquet", f"--model={tiny_dir}",
        "--id_column=ticket_id", "--columns_to_keep=ticket_id,text,priority",
        f"--output={out}/labeled", "--max_batch_size=8", "--verify=false"])

    n_in = len(good) + len(bad) + 1
    labeled, failed = _read_parquet(f"{out}/labeled-*.parquet"), _read_parquet(f"{out}/failed-*.parquet")
    assert labeled.num_rows + failed.num_rows == n_in
    assert (summary["rows_read"], summary["labeled"], summary["failed"]) == (n_in, labeled.num_rows,
                                                                            failed.num_rows)
    assert summary["accounted_for"] and sum(summary["label_counts"].values()) == labeled.num_rows

    # The documented schema: kept columns with their input types, then the classification.
    assert labeled.schema.names == (["ticket_id", "text", "priority", "label", "score"]
                                    + [prob_column(n) for n in SUPPORT.label_names]
                                    + ["truncated", "prompt_fingerprint", "model"])
    assert labeled.schema.field("priority").type == pa.int64()
    assert labeled.schema.field("score").type == pa.float64()
    assert labeled.schema.field("truncated").type == pa.bool_()
    assert failed.schema.names == ["id", "reason", "error", "stage", "row"]

    reasons = {r["id"]: r for r in failed.to_pylist()}
    assert {k: r["reason"] for k, r in reasons.items()} == {
        "B-null": "null_text", "B-empty": "empty_text", "B-int": "wrong_type"}
    assert json.loads(reasons["B-int"]["row"]) == {"ticket_id": "B-int", "text": 12345, "priority": 0}
    assert all(r["stage"] == "validate" and r["error"] for r in reasons.values())

    rows = {r["ticket_id"]: r for r in labeled.to_pylist()}
    assert rows["B-long"]["truncated"] is True and summary["rows_truncated"] == 1
    reference = _reference(tiny_dir, [r["text"] for r in good] + [LONG_TEXT])
    for text, ref in reference.items():
        row = next(r for r in rows.values() if r["text"] == text)
        assert row["label"] == ref.label, (text, row["label"], ref.label)
        for name in SUPPORT.label_names:
            assert abs(row[prob_column(name)] - ref.scores[name]) <= 1e-4
    with open(f"{out}/labeled-summary.json", encoding="utf-8") as f:
        assert json.load(f)["labeled"] == labeled.num_rows


def test_top_k_list_of_structs_in_parquet(tiny_dir, tmp_path):
    """--top_k writes a list<struct<label, score>> column; --prob_columns false drops the
    per-label columns."""
    rows = [{"ticket_id": f"T{i}", "text": t} for i, t in enumerate(TEXTS[:6])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    summary = classify.run([
        "--runner=DirectRunner", f"--input={tmp_path}/in.parquet", f"--model={tiny_dir}", "--id_column=ticket_id",
        f"--output={tmp_path}/out/labeled", "--verify=false", "--top_k=2", "--prob_columns=false"])
    labeled = _read_parquet(f"{tmp_path}/out/labeled-*.parquet")
    assert summary["labeled"] == len(rows)
    assert summary["label_tokens_computed"] == 0 < summary["suffix_tokens_computed"]  # first-token task
    assert labeled.schema.names == ["ticket_id", "text", "label", "score", "top_k", "truncated",
                                    "prompt_fingerprint", "model"]
    assert labeled.schema.field("top_k").type == pa.list_(pa.struct([("label", pa.string()), ("score", pa.float64())]))
    reference = _reference(tiny_dir, [r["text"] for r in rows])
    for row in labeled.to_pylist():
        ref = reference[row["text"]]
        assert [r["label"] for r in row["top_k"]] == [n for n, _ in ref.top(2)]
        assert all(abs(r["score"] - ref.scores[r["label"]]) <= 1e-4 for r in row["top_k"])


def test_jsonl_lone_surrogate_fails_its_line_only(tiny_dir, tmp_path):
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS[:3])]
    lines.insert(1, '{"id": "S", "text": "abc \\ud800 def"}')  # valid JSON, not valid Unicode
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = classify.run([
        "--runner=DirectRunner", f"--input={tmp_path}/rows.jsonl", f"--model={tiny_dir}", "--id_column=id",
        f"--output={tmp_path}/out/labeled", "--verify=false"])
    failed = _read_parquet(f"{tmp_path}/out/failed-*.parquet").to_pylist()
    assert [(r["reason"], r["stage"]) for r in failed] == [("invalid_unicode", "read")]
    assert "ud800" in failed[0]["row"]
    assert (summary["rows_read"], summary["labeled"], summary["failed"]) == (4, 3, 1) and summary["accounted_for"]


def test_csv_and_jsonl_edge_cases_each_end_in_one_output(tiny_dir, tmp_path):
    """A BOM, a 200,000-character field, a ragged row, bytes that are not UTF-8: each row is
    labelled or fails alone with a reason; nothing stops the run."""
    long_text = "word " * 40_000
    csv_bytes = ("\ufefftext,ticket_id\n" f"app crashes,T1\n\"{long_text}\",T2\nextra,T3,surplus\n"
                 "fine again,T4\n").encode("utf-8") + b"caf\xe9 latin-1,T5\n"
    (tmp_path / "in.csv").write_bytes(csv_bytes)
    summary = classify.run([
        "--runner=DirectRunner", f"--input={tmp_path}/in.csv", f"--model={tiny_dir}", "--id_column=ticket_id",
        f"--output={tmp_path}/csv/labeled", "--verify=false"])
    labeled = _read_parquet(f"{tmp_path}/csv/labeled-*.parquet").to_pylist()
    failed = _read_parquet(f"{tmp_path}/csv/failed-*.parquet").to_pylist()
    assert sorted(r["ticket_id"] for r in labeled) == ["T1", "T2", "T4"]  # BOM gone: "text" is the column
    assert next(r for r in labeled if r["ticket_id"] == "T2")["truncated"] is True
    assert sorted(r["reason"] for r in failed) == ["undecodable", "unparseable"]
    assert summary["rows_read"] == 5 and summary["accounted_for"]

    jsonl = b"\xef\xbb\xbf" + json.dumps({"id": 1, "text": "app crashes"}).encode() + b"\n" \
        + b'{"id": 2, "text": "caf\xe9"}\n' + json.dumps({"id": 3, "text": "refund?"}).encode() + b"\n"
    (tmp_path / "in.jsonl").write_bytes(jsonl)
    summary = classify.run([
        "--runner=DirectRunner", f"--input={tmp_path}/in.jsonl", f"--model={tiny_dir}", "--id_column=id",
        f"--output={tmp_path}/jsonl/labeled", "--verify=false"])
    failed = _read_parquet(f"{tmp_path}/jsonl/failed-*.parquet").to_pylist()
    assert [(r["reason"], r["stage"]) for r in failed] == [("undecodable", "read")]
    assert (summary["labeled"], summary["failed"]) == (2, 1) and summary["accounted_for"]


@pytest.mark.parametrize("ext", ["csv", "jsonl", "parquet"])
def test_input_that_matches_nothing_fails_at_launch(tmp_path, ext):
    for pattern in (f"{tmp_path}/missing.{ext}", f"{tmp_path}/none-*.{ext}"):
        with pytest.raises(ValueError, match="matches no file"):
            classify.run(["--runner=DirectRunner", f"--input={pattern}", f"--output={tmp_path}/out"])


def test_jsonl_in_with_an_unparseable_line_and_jsonl_out(tiny_dir, tmp_path):
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS[:5])]
    lines.insert(2, "{not json")
    lines.append("[1, 2]")
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = classify.run([
        "--runner=DirectRunner", f"--input={tmp_path}/rows.jsonl", f"--model={tiny_dir}", "--id_column=id",
        f"--output={tmp_path}/out/labeled", "--output_format=jsonl", "--verify=false"])
    labeled = [json.loads(l) for p in glob.glob(f"{tmp_path}/out/labeled-*.jsonl") for l in open(p)]
    failed = [json.loads(l) for p in glob.glob(f"{tmp_path}/out/failed-*.jsonl") for l in open(p)]
    assert sorted(r["id"] for r in labeled) == ["0", "1", "2", "3", "4"]  # no schema: kept as text
    assert sorted(r["reason"] for r in failed) == ["unparseable", "unparseable"]
    assert {r["stage"] for r in failed} == {"read"}
    assert summary["rows_read"] == 7 and summary["accounted_for"]


def test_csv_in_with_gold_labels_reports_accuracy_and_a_confusion_png(tiny_dir, tmp_path):
    csv_path = os.path.join(os.path.dirname(__file__), "..", "pipelines", "data", "sample_tickets.csv")
    summary = classify.run([
        "--runner=DirectRunner", f"--input={csv_path}", f"--model={tiny_dir}", "--id_column=ticket_id",
        "--eval_label_column=label", f"--output={tmp_path}/labeled", "--verify=false"])
    labeled = _read_parquet(f"{tmp_path}/labeled-*.parquet").to_pylist()
    gold = {r["ticket_id"]: r["label"] for r in pq.read_table(
        os.path.join(os.path.dirname(csv_path), "sample_tickets.parquet")).to_pylist()}
    correct = sum(gold[r["ticket_id"]] == r["label"] for r in labeled)
    assert summary["evaluation"]["rows"] == 60
    assert summary["evaluation"]["accuracy"] == round(correct / 60, 4)
    confusion = summary["evaluation"]["confusion"]
    assert sum(n for _, _, n in confusion) == 60
    with open(summary["outputs"]["confusion_matrix"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("where", ["labelled", "failed"])
def test_failure_mid_run_leaves_no_files_at_all(tiny_dir, tmp_path, monkeypatch, where):
    """A failure in the labelled branch or in the failed-rows write (the second output to
    finalize): nothing is published, no summary, no staging or beam-temp leftovers."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    _write_inputs(inputs)
    seen = []
    if where == "labelled":
        original = ToOutputRow.process

        def fail_on_fifth_row(self, row):
            seen.append(row)
            if len(seen) == 5:
                raise RuntimeError("injected failure")
            yield from original(self, row)

        monkeypatch.setattr(ToOutputRow, "process", fail_on_fifth_row)
    else:
        def fail_a_failed_row(record):
            seen.append(record)
            raise RuntimeError("injected failure")

        from beam_prefix.pipelines import launch  # where the pipelines' failed rows are shaped

        monkeypatch.setattr(launch, "failed_output_row", fail_a_failed_row)
    with pytest.raises(Exception, match="injected failure"):
        classify.run(["--runner=DirectRunner", f"--input={inputs}/*.parquet", f"--model={tiny_dir}",
                      f"--output={tmp_path}/out/labeled", "--verify=false", "--max_batch_size=2"])
    assert seen or where == "failed"  # (that function runs on a pickled copy)
    assert not (tmp_path / "out").exists()  # nor the output folder the run made (left empty: removed)


def test_unwritable_output_fails_before_the_model_loads(tiny_dir, tmp_path, monkeypatch, capsys):
    import beam_prefix.beam.worker

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(beam_prefix.beam.worker, "load_model", no_load)
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "out").mkdir()
    for flag, value in (("--output", f"{tmp_path}/a_file/labeled"),
                        ("--summary_output", f"{tmp_path}/a_file/summary.json"),
                        ("--failed_output", f"{tmp_path}/a_file/failed")):
        argv = ["--runner=DirectRunner", f"--model={tiny_dir}", f"{flag}={value}"]
        if flag != "--output":
            argv.append(f"--output={tmp_path}/out/labeled")
        assert classify.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {flag}={value}: cannot write") and "\n" not in err, err
        assert "Traceback" not in err
        assert os.listdir(tmp_path / "out") == []  # the good location's staging is gone too


def test_launch_errors_exit_2_in_one_line(tmp_path, capsys):
    (tmp_path / "in.csv").write_text("ticket_id,text\nT1,hello\n", encoding="utf-8")
    for argv, message in (
            ([f"--input={tmp_path}/in.csv", "--columns_to_keep=ticket_id,priority"], "input lacks: ['priority']"),
            ([f"--input={tmp_path}/in.csv", "--text_column=body"], "input lacks: ['body']"),
            ([f"--input={tmp_path}/none-*.csv"], "matches no file"),
            (["--task=/no/such/task.yaml"], "cannot be read")):
        assert classify.main(["--runner=DirectRunner", f"--output={tmp_path}/out/labeled", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_a_runner_error_is_one_line_naming_the_outputs():
    from beam_prefix.pipelines.classify import explain

    line = explain(RuntimeError("Pipeline failed\nTraceback...\nRuntimeError: Channel closed prematurely."),
                   {"labeled": "out/labeled-*.parquet", "failed": "out/failed-*.parquet"})
    assert "\n" not in line and "a worker process died" in line and "out/labeled-*.parquet" in line


def test_embedded_defaults_with_no_arguments(tmp_path, monkeypatch, capsys):
    """The first run: the sample with its gold labels, start-up apart from classification,
    the self-check's own cached-vs-full timing, accuracy and a confusion PNG."""
    monkeypatch.chdir(tmp_path)
    summary = classify.run(["--runner=DirectRunner"])
    labeled = _read_parquet("output/labeled-*.parquet")
    assert summary["rows_read"] == 60 and summary["labeled"] == labeled.num_rows == 60
    assert summary["model"] == "embedded" and summary["task"] == "support_tickets"
    # every row reused the same prefix, several times longer than its own suffix
    assert summary["prefix_tokens_reused"] % 60 == 0
    assert summary["prefix_tokens_reused"] > 5 * summary["suffix_tokens_computed"] > 0
    with open("output/labeled-summary.json", encoding="utf-8") as f:
        written = json.load(f)
    assert written["label_counts"] == summary["label_counts"]
    gold = {r["text"]: r["label"] for r in pq.read_table(SAMPLE_TICKETS).to_pylist()}
    correct = sum(gold[r["text"]] == r["label"] for r in labeled.to_pylist())  # `label`: the prediction
    assert summary["evaluation"]["rows"] == 60 and summary["evaluation"]["accuracy"] == round(correct / 60, 4)
    assert os.path.exists("output/labeled-confusion.png")
    up, run, check = summary["startup"], summary["classification"], summary["self_check"]
    assert up["model_load_s"] > 0 and up["prefix_build_s"] > 0 and up["self_check_s"] > 0
    assert up["prefix_builds"] == 1
    assert run["rows"] == 60 and run["model_s"] > 0
    assert run["ms_per_row"] == pytest.approx(1e3 * run["model_s"] / 60, rel=0.01)
    assert check["cached_ms_per_row"] > 0 and check["full_ms_per_row"] > 0
    printed = capsys.readouterr().out
    assert "rows read 60: labelled 60 + failed 0" in printed and "output/labeled-*.parquet" in printed
    for line in ("start-up ", "classification: 60 rows", "self-check: cached", "accuracy against 'label'",
                 "confusion_matrix: output/labeled-confusion.png"):
        assert line in printed, line


@pytest.mark.parametrize("runner_flags", [
    ["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=LOOPBACK"],
    # Flink's path with workers in their own processes (the embedded job service has no PROCESS env)
    ["--runner=PortableRunner", "--job_endpoint=embed",
     "--environment_type=beam:env:harness_subprocess_python:v1",
     f"--environment_config={sys.executable} -m apache_beam.runners.worker.sdk_worker_main"],
], ids=["loopback", "subprocess_workers"])
def test_portable_runner_matches_full_reencoding(tiny_dir, tmp_path, runner_flags):
    inputs = tmp_path / "in"
    inputs.mkdir()
    good, bad = _write_inputs(inputs)
    summary = classify.run([*runner_flags, f"--input={inputs}/*.parquet", f"--model={tiny_dir}",
                            "--id_column=ticket_id", f"--output={tmp_path}/out/labeled", "--verify=false"])
    labeled = _read_parquet(f"{tmp_path}/out/labeled-*.parquet").to_pylist()
    failed = _read_parquet(f"{tmp_path}/out/failed-*.parquet").to_pylist()
    assert len(labeled) + len(failed) == len(good) + len(bad) + 1 == summary["rows_read"]
    assert summary["accounted_for"]
    reference = _reference(tiny_dir, [r["text"] for r in good])
    by_text = {r["text"]: r for r in labeled}
    assert {t: by_text[t]["label"] for t in reference} == {t: p.label for t, p in reference.items()}


def test_make_demo_keeps_the_tickets_id_column(tiny_dir, tmp_path, monkeypatch):
    """#56.9: the demo's labelled rows carry the input's ticket_id (its flags, as the
    Makefile gives them, run on the tiny model with the task's untrained form into a folder
    of the test's own)."""
    import re
    import shlex

    import pyarrow.parquet as pq

    from conftest import ROOT

    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", f.read(), flags=re.M).group(1)
    words = shlex.split(recipe.replace("\\\n", " "))
    flags = words[words.index("pipelines.classify") + 1:]
    at = flags.index("--task")
    flags = flags[:at] + flags[at + 2:]  # (the shipped head answers on the embedded model only)
    monkeypatch.chdir(ROOT)  # the recipe's paths are the checkout's
    assert classify.main([*flags, f"--model={tiny_dir}", "--task=support_tickets", "--verify=false",
                          f"--output={tmp_path}/labeled"]) == 0
    table = pq.read_table(next(p for p in tmp_path.iterdir() if p.name.startswith("labeled-0")))
    assert table.column_names[:2] == ["ticket_id", "text"]
    assert table.column("ticket_id").to_pylist()[0].startswith("H")
