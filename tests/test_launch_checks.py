"""Launch-time checks and honest accounting (round 3): a head fit for another dtype, layers
the model lacks and float16 on a CPU machine are refused before any model loads; a
misspelt flag is refused naming the closest one; rows a head was fit on are left out of
the accuracy whatever the route or the text column's type; a step's prefix pool bound is
its own even when another pipeline in the process loaded the model first."""

from __future__ import annotations

import csv
import glob
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from beam_prefix import PrefixClassifier
from beam_prefix.tasks.trained_head import TrainedHead, text_hash
from beam_prefix.pipelines import classify, fit, launch
from beam_prefix.pipelines.options import join_negative_lists

from conftest import ROOT, SUPPORT_TASK, TEXTS, tiny_task

SAMPLE = os.path.join(os.path.dirname(SUPPORT_TASK), "..", "data", "sample_tickets.csv")


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr("beam_prefix.beam.worker.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("beam_prefix.engines.prefix_engine.load_model",
                        lambda *a, **k: pytest.fail("the model was loaded"))


def _exit_2(main, argv, capsys) -> str:
    assert main(["--runner=DirectRunner", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# -- item 3: what the task, head and model config already tell -----------------------------

def test_a_float32_head_with_bfloat16_is_refused_at_launch(tmp_path, no_model, capsys):
    err = _exit_2(classify.main, ["--task=support_tickets_head", f"--input={SAMPLE}", "--dtype=bfloat16",
                                  f"--output={tmp_path}/o/out"], capsys)
    # the two precisions named (#61.16), not a features-hash mismatch
    assert "support_tickets.head" in err and "dtype='bfloat16'" in err and "was fit in float32" in err
    assert not os.path.exists(tmp_path / "o") or os.listdir(tmp_path / "o") == []  # nothing written


def test_every_shipped_head_records_its_precision_and_one_without_is_float32(tmp_path):
    """#61.16: ClassifyText(..., dtype='bfloat16') on a float32 head is a ValueError where the
    pipeline is built, naming both precisions; a head that records none is checked as float32."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from beam_prefix.beam.classify_transform import ClassifyText
    from beam_prefix.tasks.extraction_head import EXTRACTION_HEAD_KEY
    from beam_prefix.tasks.trained_head import HEAD_METADATA_KEY

    for head in sorted((ROOT / "beam_prefix" / "shipped" / "tasks").glob("*.head")):
        with safe_open(str(head), "pt") as f:  # (an extraction head records it under its own key)
            meta = f.metadata()
            recorded = json.loads(meta.get(HEAD_METADATA_KEY) or meta[EXTRACTION_HEAD_KEY]).get("dtype")
            assert recorded in ("float32", "bfloat16"), head.name
    with pytest.raises(ValueError, match=r"dtype='bfloat16', but head .*support_tickets.head was fit in float32"):
        ClassifyText("support_tickets_head", dtype="bfloat16")
    shipped = ROOT / "beam_prefix" / "shipped" / "tasks"
    with safe_open(str(shipped / "support_tickets.head"), "pt") as f:  # a head written before heads recorded it
        meta, tensors = json.loads(f.metadata()[HEAD_METADATA_KEY]), {k: f.get_tensor(k) for k in f.keys()}
    meta.pop("dtype")
    save_file(tensors, str(tmp_path / "old.head"), metadata={HEAD_METADATA_KEY: json.dumps(meta)})
    task = tmp_path / "old.yaml"
    task.write_text(open(shipped / "support_tickets_head.yaml").read().replace("head: support_tickets.head",
                                                                               "head: old.head"))
    assert "head: old.head" in task.read_text()
    with pytest.raises(ValueError, match=r"old.head was fit in float32 \(it records no precision"):
        ClassifyText(str(task), dtype="bfloat16")
    assert ClassifyText(str(task)).config.dtype == "float32"


def test_fit_layers_the_model_lacks_are_refused_at_launch(tiny_dir, tmp_path, no_model, capsys):
    err = _exit_2(fit.main, ["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
                             f"--output={tmp_path}/t.head", f"--model={tiny_dir}", "--layers=-1,99"], capsys)
    assert "[99] out of range" in err and "labels with no training row" not in err


def test_fit_layers_given_twice_are_refused(tmp_path, no_model, capsys):
    err = _exit_2(fit.main, ["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
                             f"--output={tmp_path}/t.head", "--layers=-1,-1"], capsys)
    assert "each layer once" in err


def test_float16_on_auto_without_a_gpu_is_refused_at_launch(tmp_path, no_model, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto is the GPU")
    err = _exit_2(classify.main, [f"--input={SAMPLE}", "--device=auto", "--dtype=float16",
                                  f"--output={tmp_path}/o/out"], capsys)
    assert "--device=auto --dtype=float16" in err and "no CUDA device" in err


def test_an_error_line_is_never_cut_mid_word():
    line = launch.explain(RuntimeError("ClassifyText failed: " + " ".join(["word"] * 200) + " 'ClassifyText'"))
    inner = line[line.index("RuntimeError: "):]
    assert inner.endswith("...)") and "wor)" not in line and len(line) < 500
    assert all(w in ("word", "...)") for w in inner.split(" ")[3:])


# -- item 4: misspelt flags ---------------------------------------------------------------

@pytest.mark.parametrize("main,flags,named,suggested", [
    (classify.main, ["--eval_label_colum", "label"], "--eval_label_colum", "--eval_label_column"),
    (fit.main, ["--label_column=label", "--layer=-1,12"], "--layer", "--layers"),
    (fit.main, ["--label_column=label", "--fold", "3"], "--fold", "--folds"),
], ids=["classify", "fit-layer", "fit-fold"])
def test_a_misspelt_flag_is_refused_naming_the_closest(tmp_path, main, flags, named, suggested, no_model, capsys):
    err = _exit_2(main, [f"--input={SAMPLE}", f"--output={tmp_path}/o/out.head", *flags], capsys)
    assert f"unknown flag {named};" in err and f"did you mean {suggested}?" in err


def test_layers_with_a_space_as_the_readme_writes_it():
    assert join_negative_lists(["--layers", "-1,12", "--folds", "3"], ("--layers",)) == \
        ["--layers=-1,12", "--folds", "3"]
    assert join_negative_lists(["--layers", "-1"], ("--layers",)) == ["--layers=-1"]
    assert join_negative_lists(["--layers", "--folds=3"], ("--layers",)) == ["--layers", "--folds=3"]


# -- item 5: held-out accounting, whatever the route or the column type -------------------------

@pytest.fixture(scope="module")
def head_dir(tiny_dir, tmp_path_factory):
    """A task directory holding a head task for the tiny model, its head fit (randomly) on
    TEXTS[:3], and a plain task."""
    from test_head import _features_task, _head_for

    d = tmp_path_factory.mktemp("head_tasks")
    base = PrefixClassifier.load(_features_task(), model=tiny_dir, verify=False)
    head = _head_for(base)
    head = TrainedHead(labels=head.labels, layers=head.layers, weight=head.weight, bias=head.bias, mean=head.mean,
                       std=head.std, fingerprint=head.fingerprint, train_hashes=[text_hash(t) for t in TEXTS[:3]])
    head.save(d / "h.head")
    text = open(SUPPORT_TASK, encoding="utf-8").read().replace("calibration: true", "calibration: false")
    (d / "headed.yaml").write_text(text.replace("scoring: auto", "scoring: head\nhead: h.head"))
    spec = tiny_task()
    (d / "plain.yaml").write_text(yaml.safe_dump({"name": "plain", "instructions": spec.instructions,
                                                  "labels": list(spec.label_names)}))
    return d


def test_routed_head_rows_that_fit_it_are_left_out_and_counted(tiny_dir, head_dir, tmp_path):
    rows = [{"text": t, "task": "headed", "gold": "billing"} for t in TEXTS[:5]]  # 3 fit the head
    rows += [{"text": TEXTS[0], "task": "plain", "gold": "billing"}]  # a training text, but not for this task
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    summary = classify.run(["--runner=DirectRunner", f"--input={tmp_path}/in.parquet", f"--task_dir={head_dir}",
                            "--task_column=task", f"--model={tiny_dir}", "--eval_label_column=gold",
                            f"--output={tmp_path}/out/", "--verify=false"])
    ev = summary["evaluation"]
    assert (summary["labeled"], ev["rows"], ev["fit_rows_left_out"]) == (6, 3, 3)
    assert ev["head"].endswith("h.head")


def test_a_bytes_text_column_is_matched_against_the_heads_rows(tiny_dir, head_dir, tmp_path):
    rows = [{"text": t.encode("utf-8"), "gold": "billing"} for t in TEXTS[:5]]
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("text", pa.binary()), ("gold", pa.string())])),
                   tmp_path / "in.parquet")
    summary = classify.run(["--runner=DirectRunner", f"--input={tmp_path}/in.parquet",
                            f"--task={head_dir}/headed.yaml", f"--model={tiny_dir}", "--eval_label_column=gold",
                            f"--output={tmp_path}/out/", "--verify=false"])
    ev = summary["evaluation"]
    assert (summary["labeled"], ev["rows"], ev["fit_rows_left_out"]) == (5, 2, 3)


# -- item 8: a step's pool bound is its own -------------------------------------------------------

def test_a_second_pipeline_in_the_process_gets_its_own_pool_bound(tiny_dir, tmp_path):
    from test_routing import TASKS, _rows

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for key, spec in TASKS.items():
        (tasks / f"{key}.yaml").write_text(yaml.safe_dump(
            {"name": spec.name, "instructions": spec.instructions, "labels": [label.name for label in spec.labels],
             "scoring": spec.scoring}), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(_rows()), tmp_path / "in.parquet")
    flags = ["--runner=DirectRunner", f"--input={tmp_path}/in.parquet", f"--task_dir={tasks}", "--task_column=tenant",
             f"--model={tiny_dir}", "--verify=false", "--batch_size=1", "--max_batch_size=1"]
    first = classify.run(flags + [f"--output={tmp_path}/a/"])
    assert first["prefix_pool"]["evictions"] == 0
    second = classify.run(flags + [f"--output={tmp_path}/b/", "--max_prefix_cache_mb=0.0001"])
    pool = second["prefix_pool"]
    assert pool["builds"] >= 3 and pool["evictions"] >= 1  # its own bound, not the first run's pool


# -- item 6: fit's own edges --------------------------------------------------------------------

def test_fit_into_a_missing_folder_cleans_a_killed_fits_staging_and_survives_a_deep_jsonl_line(tiny_dir, tmp_path,
                                                                                               capsys):
    import json

    with open(SAMPLE, encoding="utf-8") as f:
        rows = [{"text": r["text"], "label": r["label"]} for r in csv.DictReader(f)]
    lines = [json.dumps(r) for r in rows] + ["[" * 100_000 + "]" * 100_000]  # fails as a row, not the launch
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "new" / "folder"
    out.mkdir(parents=True)
    stale = out / ".beam-prefix-fit-t.head-20261204-000000-deadbeef"  # what a kill -9 left
    stale.mkdir()
    (stale / "features-00000-of-00001.parquet").write_bytes(b"training rows' features")
    other = out / ".beam-prefix-fit-other.head-20261204-000000-deadbeef"  # another head's: not ours to remove
    other.mkdir()
    assert fit.main(["--runner=DirectRunner", f"--input={tmp_path}/in.jsonl", "--label_column=label",
                     f"--output={out}/t.head", f"--model={tiny_dir}", "--verify=false", "--folds=3"]) == 0
    assert sorted(os.listdir(out)) == [other.name, "t.head"]  # the stale staging gone, no staging left
    assert "rows: 60 used, 1 failed" in capsys.readouterr().out
    fresh = tmp_path / "missing" / "dir"
    assert fit.main(["--runner=DirectRunner", f"--input={SAMPLE}", "--label_column=label", f"--output={fresh}/t.head",
                     f"--model={tiny_dir}", "--verify=false", "--folds=3"]) == 0
    assert os.listdir(fresh) == ["t.head"]


def test_fit_with_a_label_of_one_row_says_there_was_no_cross_validation():
    out = fit._format({"head": "h", "task": "t", "features": 4, "layers": [-1], "rows_used": 4, "rows_failed": 0,
                       "features_s": 1.0, "fit_s": 0.1, "kfold_accuracy": None, "folds": 0, "C": 1.0,
                       "note": "a label has a single row: no cross-validation", "worst_label_f1": []})
    assert "no cross-validation (a label has a single row" in out and "0-fold" not in out and "F1" not in out


@pytest.mark.parametrize("flag", ["--number_of_execution_retries=3", "--checkpointing_interval=60000"])
def test_a_java_flink_runner_option_is_refused_with_where_to_set_it(tmp_path, flag, no_model, capsys):
    """Python's Beam drops the Java Flink runner's own options on the way to a job server,
    so a restart count given as a flag would silently not apply."""
    err = _exit_2(classify.main, ["--runner=PortableRunner", "--job_endpoint=localhost:8099",
                                  f"--input={SAMPLE}", f"--output={tmp_path}/o/out", flag], capsys)
    assert f"{flag.split('=')[0]} is an option of Beam's Java Flink runner" in err and "--flink-conf-dir" in err
