"""Per-row task routing: one ClassifyText step, many prompts, a bounded prefix pool."""

from __future__ import annotations

import threading

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_prefix import PrefixClassifier
from beam_prefix.model.loading import load_model
from beam_prefix.beam.prefix_pool import PrefixPool
from beam_prefix.beam.classify_transform import ClassifyText
from beam_prefix.beam.worker import ModelHolder

from conftest import BANKING_LABELS, TEXTS, run_in_threads, tiny_task

TASKS = {
    "support": tiny_task(("billing", "technical", "account")),
    "triage": tiny_task(("urgent", "normal", "spam", "question"), instructions="Triage the message.",
                        version="2026-12-03"),
    "banking": tiny_task(BANKING_LABELS, scoring="sequence", instructions="Route the banking request."),
}


def _rows(n_per_task=4):
    rows = []
    for i, text in enumerate(TEXTS[: 3 * n_per_task]):
        rows.append({"id": f"R{i}", "tenant": list(TASKS)[i % 3], "text": text})
    return rows


def _reference(model_dir, rows):
    loaded = load_model(model_dir)
    out = {}
    for key, spec in TASKS.items():
        mine = [r for r in rows if r["tenant"] == key]
        clf = PrefixClassifier(task=spec, loaded=loaded, verify=False)
        for row, pred in zip(mine, clf.classify_full([r["text"] for r in mine])):
            out[row["id"]] = (key, pred, clf.fingerprint)
    return out


def _counters(result):
    return {c.key.metric.name: c.committed for c in
            result.metrics().query(MetricsFilter().with_namespace("beam_prefix"))["counters"]}


def test_rows_routed_to_three_tasks_equal_each_tasks_full_reencoding(tiny_dir):
    rows = _rows() + [{"id": "U1", "tenant": "nobody", "text": "hello"}, {"id": "U2", "text": "no tenant"}]
    reference = _reference(tiny_dir, _rows())

    def check(labeled):
        assert len(labeled) == len(reference)
        for row in labeled:
            key, pred, fingerprint = reference[row["id"]]
            assert (row["task"], row["label"], row["prompt_fingerprint"]) == (key, pred.label, fingerprint)
            assert abs(row["score"] - pred.score) <= 1e-4
            assert row["task_version"] == TASKS[key].version
            assert not [c for c in row if c.startswith("prob_")]  # label sets differ
            assert row["top_k"][0]["label"] == pred.label  # (the runner-up may be a near tie)
            assert all(abs(e["score"] - pred.scores[e["label"]]) <= 1e-4 for e in row["top_k"])

    with TestPipeline() as p:
        result = p | beam.Create(rows) | ClassifyText(tasks=TASKS, task_column="tenant", model=tiny_dir, top_k=2,
                                                     id_column="id", max_batch_size=3)
        assert_that(result.labeled, check, label="EachRowItsTask")
        assert_that(result.failed | beam.Map(lambda r: (r["id"], r["reason"])),
                    equal_to([("U1", "unknown_task"), ("U2", "unknown_task")]), label="UnknownTask")
        total = (result.labeled, result.failed) | beam.Flatten() | beam.combiners.Count.Globally()
        assert_that(total, equal_to([len(rows)]), label="RowsConserved")


def test_unknown_task_error_lists_known_keys(tiny_dir):
    with TestPipeline() as p:
        result = (p | beam.Create([{"tenant": "nobody", "text": "x"}])
                  | ClassifyText(tasks=TASKS, task_column="tenant", model=tiny_dir))
        assert_that(result.failed | beam.Map(lambda r: "banking, support, triage" in r["error"]), equal_to([True]))


def test_a_small_pool_evicts_and_rebuilds_with_identical_results(tiny_dir):
    rows = _rows(6)
    reference = _reference(tiny_dir, rows)
    loaded = load_model(tiny_dir)
    sizes = [PrefixClassifier(task=spec, loaded=loaded, verify=False).prefix_cache.nbytes for spec in TASKS.values()]
    bound_mb = 1.01 * (sum(sizes) - min(sizes)) / 2**20  # never all three at once
    assert max(sizes) <= bound_mb * 2**20
    path = f"{tiny_dir}/../tiny-llama"  # another model spec: its own holder and pool in this process
    p = beam.Pipeline(options=PipelineOptions([]))
    result = (p | beam.Create(rows, reshuffle=False)
              | ClassifyText(tasks=TASKS, task_column="tenant", model=path, id_column="id", max_batch_size=2,
                             max_prefix_cache_mb=bound_mb, verify=False))
    labels = result.labeled | beam.Map(lambda r: (r["id"], r["label"]))
    assert_that(labels, equal_to([(k, v[1].label) for k, v in reference.items()]))
    run = p.run()
    run.wait_until_finish()
    counters = _counters(run)
    assert counters["prefix_evictions"] > 0 and counters["prefix_builds"] > len(TASKS)
    assert counters["prefix_builds"] + counters.get("prefix_hits", 0) == sum(
        v for k, v in counters.items() if k.startswith("task_batches:"))
    assert sum(v for k, v in counters.items() if k.startswith("task_rows:")) == len(rows)
    (pool,) = ModelHolder.last.pools.values()  # the one routed step's pool
    assert pool.peak_bytes <= bound_mb * 2**20


def test_one_build_per_task_under_many_threads(tiny_models):
    pool = PrefixPool(2**30)
    builds = []
    lock = threading.Lock()
    loaded = tiny_models["llama"]

    def build(key):
        def make():
            with lock:
                builds.append(key)
            return PrefixClassifier(task=TASKS[key], loaded=loaded, verify=False)
        return make

    keys = list(TASKS)
    results = run_in_threads(lambda i: [pool.get(keys[(i + j) % 3], build(keys[(i + j) % 3])).engine
                                        for j in range(6)], 8)
    assert sorted(builds) == sorted(keys)  # each task built once
    assert len({id(clf) for per_thread in results for clf in per_thread}) == 3  # one classifier per task
    assert pool.builds == 3 and pool.hits == 8 * 6 - 3


def test_routing_arguments_are_checked():
    with pytest.raises(ValueError, match="either task"):
        ClassifyText(task=TASKS["support"], tasks=TASKS, task_column="tenant")
    with pytest.raises(ValueError, match="needs task_column"):
        ClassifyText(tasks=TASKS)
    with pytest.raises(ValueError, match="same labels"):
        ClassifyText(tasks=TASKS, task_column="tenant", prob_columns=True)
    same = {"a": TASKS["support"], "b": TASKS["support"].replace(instructions="Other words.")}
    routed = ClassifyText(tasks=same, task_column="tenant")
    assert "prob_billing" in routed.config.output_columns and "task" in routed.config.output_columns


def test_task_directory_keys_by_file_stem(tmp_path):
    import shutil

    from conftest import SUPPORT_TASK

    shutil.copy(SUPPORT_TASK, tmp_path / "acme.yaml")
    shutil.copy(SUPPORT_TASK, tmp_path / "globex.yml")
    routed = ClassifyText(tasks=str(tmp_path), task_column="tenant")
    assert [k for k, _ in routed.routes.configs] == ["acme", "globex"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        ClassifyText(tasks=str(tmp_path / "empty"), task_column="tenant")
    with pytest.raises(ValueError, match="not a directory"):
        ClassifyText(tasks=str(tmp_path / "acme.yaml"), task_column="tenant")


def test_routing_on_worker_processes(tiny_dir):
    rows = _rows()
    reference = _reference(tiny_dir, rows)
    options = PipelineOptions(["--direct_running_mode=multi_processing", "--direct_num_workers=2"])
    p = beam.Pipeline(options=options)
    result = p | beam.Create(rows) | ClassifyText(tasks=TASKS, task_column="tenant", model=tiny_dir, verify=False)
    assert_that(result.labeled | beam.Map(lambda r: (r["id"], r["task"], r["label"])),
                equal_to([(k, v[0], v[1].label) for k, v in reference.items()]))
    run = p.run()
    run.wait_until_finish()
    counters = _counters(run)
    assert len(TASKS) <= counters["prefix_builds"] <= 2 * len(TASKS)  # once per task per worker process, at most


def test_version_is_in_the_fingerprint_and_on_every_row(tiny_dir):
    from beam_prefix.beam.classify_dofn import ClassifyConfig

    loaded = load_model(tiny_dir)
    plain = TASKS["support"]
    v1, v2 = plain.replace(version="1"), plain.replace(version="2")
    prints = {PrefixClassifier(task=t, loaded=loaded, verify=False).fingerprint for t in (plain, v1, v2)}
    assert len(prints) == 3
    assert "task_version" in ClassifyConfig(task=v1).output_columns
    assert "task_version" not in ClassifyConfig(task=plain).output_columns  # unversioned: columns unchanged
    with TestPipeline() as p:
        labeled = (p | beam.Create([{"text": t} for t in TEXTS[:3]])
                   | ClassifyText(task=v2, model=tiny_dir, verify=False)).labeled
        assert_that(labeled | beam.Map(lambda r: r["task_version"]), equal_to(["2"] * 3))


def test_pipeline_with_a_task_directory(tiny_dir, tmp_path, capsys):
    """`python -m pipelines.classify --task_dir --task_column`, Parquet in and out, with the
    per-task summary."""
    import glob

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from beam_prefix.pipelines import classify

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for key, spec in TASKS.items():
        # instructions of this test's own: no other test in the process has pooled these prefixes,
        # so the run builds each one itself (the summary's builds below)
        data = {"name": spec.name, "instructions": f"{spec.instructions} ({tmp_path.name})",
                "labels": [label.name for label in spec.labels], "scoring": spec.scoring,
                "suffix_template": spec.suffix_template}
        if spec.version:
            data["version"] = spec.version
        (tasks / f"{key}.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    rows = _rows() + [{"id": "U1", "tenant": "nobody", "text": "hello"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    summary = classify.run([
        "--runner=DirectRunner", f"--input={tmp_path}/in.parquet", f"--task_dir={tasks}", "--task_column=tenant",
        f"--model={tiny_dir}", "--id_column=id", "--columns_to_keep=id,tenant,text", "--top_k=2",
        f"--output={tmp_path}/out/labeled", "--verify=false"])
    labeled = pa.concat_tables([pq.read_table(p) for p in glob.glob(f"{tmp_path}/out/labeled-*.parquet")])
    failed = pa.concat_tables([pq.read_table(p) for p in glob.glob(f"{tmp_path}/out/failed-*.parquet")])
    assert labeled.num_rows == 12 and failed.to_pylist()[0]["reason"] == "unknown_task"
    assert {"task", "task_version", "top_k"} <= set(labeled.column_names)
    assert not [c for c in labeled.column_names if c.startswith("prob_")]
    assert all(r["task"] == r["tenant"] for r in labeled.to_pylist())
    assert summary["accounted_for"] and summary["rows_read"] == 13
    assert {t["task"]: t["rows"] for t in summary["tasks"]} == {"support": 4, "triage": 4, "banking": 4}
    assert summary["prefix_pool"]["builds"] >= 3
    printed = capsys.readouterr().out
    assert "prefix pool:" in printed and "tasks (top 20 by rows):" in printed


def test_routing_in_streaming_and_with_a_batch_duration(tiny_dir):
    """Streaming (TestStream): rows batched per bundle and grouped by task, each keeping its
    timestamp; batch mode with max_batch_duration_secs: the same rows, every one once."""
    from apache_beam.options.pipeline_options import StandardOptions
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms import window

    rows = _rows(2) + [{"id": "U1", "tenant": "nobody", "text": "hello"}]
    reference = _reference(tiny_dir, _rows(2))
    stream = (TestStream().add_elements([window.TimestampedValue(r, i) for i, r in enumerate(rows[:3])])
              .advance_watermark_to(10).add_elements([window.TimestampedValue(r, 10 + i) for i, r in enumerate(rows[3:])])
              .advance_processing_time(5).advance_watermark_to_infinity())
    options = PipelineOptions()
    options.view_as(StandardOptions).streaming = True
    stamps = {r["id"]: i if i < 3 else 10 + i - 3 for i, r in enumerate(rows)}
    with TestPipeline(options=options) as p:
        result = p | stream | ClassifyText(tasks=TASKS, task_column="tenant", model=tiny_dir, id_column="id",
                                           verify=False)
        assert_that(result.labeled | beam.Map(lambda r, ts=beam.DoFn.TimestampParam: (r["id"], r["label"],
                                                                                      ts.micros // 10**6)),
                    equal_to([(k, v[1].label, stamps[k]) for k, v in reference.items()]), label="Labeled")
        assert_that(result.failed | beam.Map(lambda r: (r["id"], r["reason"])), equal_to([("U1", "unknown_task")]),
                    label="Failed")
    with TestPipeline() as p:
        result = p | beam.Create(rows) | ClassifyText(tasks=TASKS, task_column="tenant", model=tiny_dir,
                                                     max_batch_duration_secs=1, verify=False)
        total = (result.labeled, result.failed) | beam.Flatten() | beam.combiners.Count.Globally()
        assert_that(total, equal_to([len(rows)]))
