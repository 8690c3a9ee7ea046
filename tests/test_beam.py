"""Beam integration: ClassifyText on DirectRunner (threads, processes, portable), the DoFn,
dead-letter output, metrics (the RunInference handler: test_handler.py)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import threading

import apache_beam as beam
import pytest
import torch
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_prefix import PrefixClassifier
from beam_prefix.beam.classify_dofn import ClassifyConfig, PrefixCachedClassifyDoFn, prob_column
from beam_prefix.model.loading import load_model
from beam_prefix.beam.classify_transform import ClassifyText
from beam_prefix.beam.worker import ModelHolder

from conftest import TEXTS, run_in_threads, tiny_task

LABELS = ("billing", "technical", "account")
GOOD = [{"ticket_id": f"T{i}", "text": t, "channel": "email"} for i, t in enumerate(TEXTS)]
BAD = [
    {"ticket_id": "B1", "text": None},
    {"ticket_id": "B2", "text": ""},
    {"ticket_id": "B3", "text": 12345},
    {"ticket_id": "B4", "body": "no text column"},
    {"ticket_id": "B5", "text": b"\xff\xfe not utf-8"},
    {"ticket_id": "B6", "text": "word " * 400},  # over budget, overflow=reject
]
BAD_REASONS = {"B1": "null_text", "B2": "empty_text", "B3": "wrong_type", "B4": "missing_column",
               "B5": "undecodable", "B6": "too_long"}


def _unique_model_path(tiny_dir, tmp_path):
    """A fresh path to the same model, so this test's model loads are counted from zero."""
    link = tmp_path / f"model-{os.getpid()}-{threading.get_ident()}"
    os.symlink(tiny_dir, link)
    return str(link)


def _task(**changes):
    return tiny_task(LABELS, **{"overflow": "reject", "max_text_tokens": 64, **changes})


def _reference(model_dir, task, texts):
    clf = PrefixClassifier(task=task, loaded=load_model(model_dir), verify=False)
    return {t: p for t, p in zip(texts, clf.classify_full(texts))}


def _matches_reference(reference, atol=1e-4):
    def check(rows):
        assert len(rows) == len(reference), (len(rows), len(reference))
        for row in rows:
            ref = reference[row["text"]]
            assert row["label"] == ref.label, row
            assert abs(row["score"] - ref.score) <= atol
            for name in LABELS:
                assert abs(row[prob_column(name)] - ref.scores[name]) <= atol
            assert row["channel"] == "email" and row["ticket_id"].startswith("T")
            assert row["prompt_fingerprint"] and row["model"]
    return check


def _failed_reasons(rows):
    return sorted((r["id"], r["reason"], r["stage"]) for r in rows)


def _read_jsonl(pattern):
    rows = []
    for path in glob.glob(pattern):
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _run(tiny_dir, task, rows, options=None, **kwargs):
    """Run ClassifyText; outputs go through files, so worker processes can write them."""
    out = tempfile.mkdtemp(prefix="beam-prefix-test-")
    p = beam.Pipeline(options=PipelineOptions(options or []))
    result = (p | beam.Create(rows, reshuffle=False)
              | ClassifyText(task=task, model=tiny_dir, id_column="ticket_id", max_batch_size=8, **kwargs))
    for name in ("labeled", "failed"):
        (result[name] | f"Json{name}" >> beam.Map(lambda r: json.dumps(r, default=repr, sort_keys=True))
         | f"Write{name}" >> beam.io.WriteToText(os.path.join(out, name), file_name_suffix=".jsonl"))
    try:
        run = p.run()
        run.wait_until_finish()
        return _read_jsonl(os.path.join(out, "labeled*")), _read_jsonl(os.path.join(out, "failed*")), run
    finally:
        shutil.rmtree(out, ignore_errors=True)  # each run left a folder in /tmp


def test_classify_text_equals_full_reencoding_and_conserves_rows(tiny_dir):
    task = _task()
    reference = _reference(tiny_dir, task, TEXTS)
    with TestPipeline() as p:
        result = (p | beam.Create(GOOD + BAD)
                  | ClassifyText(task=task, model=tiny_dir, id_column="ticket_id", max_batch_size=5))
        assert_that(result.labeled, _matches_reference(reference), label="LabeledEqualsFull")
        assert_that(result.failed | beam.Map(lambda r: (r["id"], r["reason"], r["stage"])),
                    equal_to([(k, v, "validate") for k, v in BAD_REASONS.items()]), label="FailedReasons")
        total = ((result.labeled, result.failed) | beam.Flatten() | beam.combiners.Count.Globally())
        assert_that(total, equal_to([len(GOOD) + len(BAD)]), label="RowsConserved")


def test_failed_rows_keep_the_original_row(tiny_dir):
    _, failed, _ = _run(tiny_dir, _task(), BAD)
    by_id = {r["id"]: r for r in failed}
    assert by_id["B4"]["row"] == {"ticket_id": "B4", "body": "no text column"}
    assert "over the budget" in by_id["B6"]["error"]


def test_beam_batches_default_to_several_forward_batches():
    # the DoFn sorts a Beam batch by length: several forward batches per Beam batch pack
    # similar lengths together, also when a user raises batch_size alone
    bounds = lambda t: (t._batching["min_batch_size"], t._batching["max_batch_size"])
    assert bounds(ClassifyText(task=_task())) == (8, 64)
    assert bounds(ClassifyText(task=_task(), batch_size=64)) == (8, 256)
    assert bounds(ClassifyText(task=_task(), min_batch_size=100)) == (100, 100)
    assert bounds(ClassifyText(task=_task(), max_batch_size=4)) == (4, 4)
    with pytest.raises(ValueError, match="min_batch_size <= max_batch_size"):
        ClassifyText(task=_task(), min_batch_size=10, max_batch_size=5)


def test_beam_rows_and_metrics(tiny_dir, tmp_path):
    model = _unique_model_path(tiny_dir, tmp_path)
    rows = [beam.Row(ticket_id=r["ticket_id"], text=r["text"], channel=r["channel"]) for r in GOOD]
    labeled, failed, run = _run(model, _task(), rows + [beam.Row(ticket_id="B1", text="  ", channel="x")])
    assert len(labeled) == len(GOOD) and len(failed) == 1
    counters = {m.key.metric.name: m.committed
                for m in run.metrics().query(MetricsFilter().with_namespace("beam_prefix"))["counters"]}
    assert counters["rows_classified"] == len(GOOD)
    assert counters["rows_failed"] == 1
    prefix_len = PrefixClassifier(task=_task(), loaded=load_model(model), verify=False).prefix_length
    assert counters["prefix_tokens_reused"] == prefix_len * len(GOOD)
    assert counters["suffix_tokens_computed"] > 0
    dists = {m.key.metric.name: m.committed
             for m in run.metrics().query(MetricsFilter().with_namespace("beam_prefix"))["distributions"]}
    assert dists["batch_size_rows"].sum == len(GOOD)
    assert dists["batch_latency_micros"].count >= 1


def test_model_loads_once_per_process_and_cache_once_per_task(tiny_dir, tmp_path):
    model = _unique_model_path(tiny_dir, tmp_path)
    before = ModelHolder.loads
    rows = GOOD * 4  # several bundles and batches
    options = ["--direct_num_workers=4", "--direct_running_mode=multi_threading"]
    p = beam.Pipeline(options=PipelineOptions(options))
    created = p | beam.Create(rows) | beam.Reshuffle()
    a = created | "TaskA" >> ClassifyText(task=_task(), model=model, max_batch_size=4)
    b = created | "TaskB" >> ClassifyText(task=_task(instructions="Sort the ticket."), model=model,
                                          max_batch_size=4)
    for name, res in (("A", a), ("B", b)):
        assert_that(res.labeled | f"Count{name}" >> beam.combiners.Count.Globally(), equal_to([len(rows)]),
                    label=f"AllRows{name}")
    p.run().wait_until_finish()
    assert ModelHolder.loads - before == 1  # two steps, several threads: one model load
    holder = ModelHolder.last
    assert holder.prefix_builds == 2  # one prefix cache per task, shared by that task's threads
    assert holder.forks >= 2


def _outputs_on(tiny_dir, options):
    labeled, failed, _ = _run(tiny_dir, _task(), GOOD + BAD, options=options)
    return (sorted((r["ticket_id"], r["label"], round(r["score"], 5)) for r in labeled),
            _failed_reasons(failed))


def test_same_output_on_threads_processes_and_portable_runner(tiny_dir):
    baseline = _outputs_on(tiny_dir, [])
    assert len(baseline[0]) == len(GOOD) and len(baseline[1]) == len(BAD)
    variants = {
        "threads": ["--direct_num_workers=4", "--direct_running_mode=multi_threading"],
        "processes": ["--direct_num_workers=2", "--direct_running_mode=multi_processing"],
        "portable": ["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=LOOPBACK"],
    }
    for name, options in variants.items():
        assert _outputs_on(tiny_dir, options) == baseline, name


def _dofn(tiny_dir, **task_changes):
    fn = PrefixCachedClassifyDoFn(ClassifyConfig(task=_task(**task_changes), model=tiny_dir, id_column="ticket_id"))
    fn.setup()
    return fn


def test_forward_failure_retries_row_by_row_and_restores_the_cache(tiny_dir, monkeypatch):
    fn = _dofn(tiny_dir)
    expected = {r["ticket_id"]: r for r in fn.process(GOOD)}
    base_cls = type(fn._engine.model.base_model)
    original = base_cls.forward
    calls = {"n": 0}

    def fail_first_batch(self, *args, **kwargs):
        calls["n"] += 1
        out = original(self, *args, **kwargs)  # the working cache has grown when it fails
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return out

    monkeypatch.setattr(base_cls, "forward", fail_first_batch)
    out = list(fn.process(GOOD[:5]))
    assert calls["n"] == 1 + 5  # the failed batch, then each row alone
    assert fn._engine.cache_length() == fn._engine.prefix_length
    assert not [o for o in out if isinstance(o, beam.pvalue.TaggedOutput)]
    for row in out:
        assert row["label"] == expected[row["ticket_id"]]["label"]
        assert abs(row["score"] - expected[row["ticket_id"]]["score"]) <= 1e-4
    later = list(fn.process(GOOD[5:]))
    for row in later:
        assert abs(row["score"] - expected[row["ticket_id"]]["score"]) <= 1e-4


def test_a_row_that_keeps_failing_goes_to_failed_not_lost(tiny_dir, monkeypatch):
    fn = _dofn(tiny_dir)
    base_cls = type(fn._engine.model.base_model)
    original = base_cls.forward
    poison = fn._engine.encode(GOOD[2]["text"]).suffix_ids

    def holds_poison(row) -> bool:  # padded rows or one packed sequence: look anywhere
        ids = row.tolist()
        return any(tuple(ids[i:i + len(poison)]) == poison for i in range(len(ids) - len(poison) + 1))

    def fail_on_poison(self, *args, input_ids=None, **kwargs):
        if any(holds_poison(r) for r in input_ids):
            original(self, *args, input_ids=input_ids, **kwargs)
            raise RuntimeError("this row always fails")
        return original(self, *args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(base_cls, "forward", fail_on_poison)
    out = list(fn.process(GOOD[:6]))
    failed = [o.value for o in out if isinstance(o, beam.pvalue.TaggedOutput)]
    labeled = [o for o in out if not isinstance(o, beam.pvalue.TaggedOutput)]
    assert [f["id"] for f in failed] == ["T2"] and failed[0]["stage"] == "model"
    assert "always fails" in failed[0]["error"]
    assert len(labeled) == 5
    assert fn._engine.cache_length() == fn._engine.prefix_length


def test_dofn_instances_in_threads_match_single_thread(tiny_dir):
    single = {r["ticket_id"]: r["score"] for r in _dofn(tiny_dir).process(GOOD)}
    fns = [_dofn(tiny_dir) for _ in range(4)]
    assert len({id(fn._engine) for fn in fns}) == 4
    assert len({id(fn._engine.prefix_cache) for fn in fns}) == 1  # one prefix per process, read-only
    assert all(fn._engine.prefix_attention == "shared" and fn._engine._working is None for fn in fns)
    results = run_in_threads(lambda i: [r for _ in range(3) for r in fns[i].process(GOOD[i:] + GOOD[:i])], 4)
    for rows in results:
        for row in rows:
            assert abs(row["score"] - single[row["ticket_id"]]) <= 1e-5


@pytest.mark.parametrize("search", ["pruned", "exhaustive"])
def test_top_k_column_and_label_token_metrics(tiny_dir, tmp_path, search):
    """A many-label sequence task: `top_k` records instead of per-label columns, and the
    label tokens actually run counted beside the suffix tokens."""
    from test_label_search import HARD_LABELS

    model = _unique_model_path(tiny_dir, tmp_path)
    task = tiny_task(HARD_LABELS, scoring="sequence", max_text_tokens=64)
    clf = PrefixClassifier(task=task, loaded=load_model(model), verify=False, label_search="exhaustive")
    reference = dict(zip(TEXTS, clf.classify_full(TEXTS)))
    labeled, failed, run = _run(model, task, GOOD, top_k=3, prob_columns=False, label_search=search)
    assert len(labeled) == len(GOOD) and not failed
    for row in labeled:
        ref = reference[row["text"]]
        assert not [c for c in row if c.startswith("prob_")]
        assert [r["label"] for r in row["top_k"]][0] == row["label"] == ref.label
        assert len(row["top_k"]) == 3
        scores = [r["score"] for r in row["top_k"]]
        assert scores == sorted(scores, reverse=True)
        for r in row["top_k"]:
            assert abs(r["score"] - ref.scores[r["label"]]) <= 1e-4
        assert {r["label"] for r in row["top_k"]} == {n for n, _ in ref.top(3)} or \
            abs(ref.top(4)[2][1] - ref.top(4)[3][1]) <= 1e-4  # a tie at the cut
    counters = {m.key.metric.name: m.committed
                for m in run.metrics().query(MetricsFilter().with_namespace("beam_prefix"))["counters"]}
    every = clf.label_tokens * len(GOOD)
    if search == "exhaustive":
        assert counters["label_tokens_computed"] == every
    else:
        assert 0 < counters["label_tokens_computed"] < every
    assert counters["suffix_tokens_computed"] > counters["label_tokens_computed"]


def test_prob_columns_default_follows_the_label_count():
    many = tiny_task([f"intent_{i}" for i in range(40)], scoring="sequence")
    assert ClassifyText(task=many).config.prob_columns is False
    assert ClassifyText(task=many, prob_columns=True).config.prob_columns is True
    assert ClassifyText(task=_task()).config.prob_columns is True
    assert ClassifyText(task=_task(), top_k=2).config.output_columns == [
        "label", "score", *[prob_column(n) for n in LABELS], "top_k", "truncated", "prompt_fingerprint", "model"]
    with pytest.raises(ValueError, match="top_k"):
        ClassifyText(task=_task(), top_k=-1)


def test_a_row_that_raises_anything_fails_alone(tiny_dir, monkeypatch):
    """Lone surrogates, keys that do not sort, and any unexpected exception while one row is
    validated become that row's failure; the rest of its bundle is labelled."""
    odd = [{"ticket_id": "S1", "text": "abc\udc80def"}, {"ticket_id": "S2", "text": "\ud800"},
           {"ticket_id": "K1", None: "ragged csv", "body": "x"}, {"ticket_id": "K2", 3: "int key"}]
    dofn = PrefixCachedClassifyDoFn(ClassifyConfig(task=_task(), model=tiny_dir, id_column="ticket_id"))
    dofn.setup()
    out = list(dofn.process(GOOD[:3] + odd))
    failed = {o.value["id"]: o.value for o in out if isinstance(o, beam.pvalue.TaggedOutput)}
    labeled = [o for o in out if not isinstance(o, beam.pvalue.TaggedOutput)]
    assert len(labeled) == 3
    assert {k: v["reason"] for k, v in failed.items()} == {
        "S1": "invalid_unicode", "S2": "invalid_unicode", "K1": "missing_column", "K2": "missing_column"}
    assert "None" in failed["K1"]["error"] and "3" in failed["K2"]["error"]

    def broken(text):
        raise KeyError("tokenizer blew up")

    monkeypatch.setattr(dofn._engine, "encode", broken)
    out = list(dofn.process(GOOD[:2]))
    assert [(o.value["reason"], o.value["error"]) for o in out] == [
        ("invalid_row", "KeyError: 'tokenizer blew up'")] * 2


def test_input_columns_that_outputs_would_overwrite_are_refused(tiny_dir):
    """A dict row with a `label` (say, a gold label) fails `column_clash` instead of being
    silently overwritten; `keep_columns` leaves such columns out; a schema'd input or a
    `keep_columns` naming an output column is refused when the pipeline is built."""
    rows = [{"ticket_id": "T0", "text": TEXTS[0], "label": "billing"},
            {"ticket_id": "T1", "text": TEXTS[1], "prob_billing": 0.5},
            {"ticket_id": "T2", "text": TEXTS[2], "channel": "email"}]
    labeled, failed, _ = _run(tiny_dir, _task(), rows)
    assert [r["ticket_id"] for r in labeled] == ["T2"]
    assert sorted((r["id"], r["reason"]) for r in failed) == [("T0", "column_clash"), ("T1", "column_clash")]
    assert "'label'" in next(r for r in failed if r["id"] == "T0")["error"]

    labeled, failed, _ = _run(tiny_dir, _task(), rows, keep_columns=["ticket_id", "text"])
    assert failed == [] and len(labeled) == 3
    assert {tuple(sorted(r)) for r in labeled} == {tuple(sorted(
        ["ticket_id", "text", "label", "score", "truncated", "prompt_fingerprint", "model"]
        + [prob_column(n) for n in LABELS]))}
    gold_row = next(r for r in labeled if r["ticket_id"] == "T0")
    assert gold_row["label"] in LABELS  # the prediction

    with pytest.raises(ValueError, match=r"keep_columns \['score'\]"):
        ClassifyText(task=_task(), keep_columns=["text", "score"])
    with pytest.raises(ValueError, match=r"input fields \['label'\]"):
        with beam.Pipeline() as p:
            _ = p | beam.Create([beam.Row(text="x", label="y")]) | ClassifyText(task=_task(), model=tiny_dir)


def test_startup_costs_are_reported_once_per_prefix_build(tiny_dir, tmp_path):
    _, _, run = _run(_unique_model_path(tiny_dir, tmp_path), _task(), GOOD[:4])
    dists = {d.key.metric.name: d.committed
             for d in run.metrics().query(MetricsFilter().with_namespace("beam_prefix"))["distributions"]}
    for name in ("startup_model_load_ms", "startup_prefix_build_ms", "startup_self_check_ms",
                 "self_check_cached_us_per_row", "self_check_full_us_per_row"):
        assert dists[name].count == 1 and dists[name].min > 0, name


def test_each_step_has_its_own_pool_bound_and_threads(tiny_dir, tmp_path, monkeypatch):
    """Two steps on one model share the model, not their settings: each has its own prefix
    pool with its own bound, and runs its batches with its own torch thread count (the
    holder was built from whichever step came first, and gave both that step's)."""
    model = _unique_model_path(tiny_dir, tmp_path)
    seen = []
    original = PrefixCachedClassifyDoFn._call

    def recording(self, engine, encoded):
        seen.append((self.step_name, torch.get_num_threads()))
        return original(self, engine, encoded)

    monkeypatch.setattr(PrefixCachedClassifyDoFn, "_call", recording)
    threads = torch.get_num_threads()
    try:
        p = beam.Pipeline(options=PipelineOptions(["--direct_running_mode=in_memory"]))
        rows = p | beam.Create(GOOD)
        _ = rows | "Small" >> ClassifyText(task=_task(), model=model, max_prefix_cache_mb=1, threads=1, verify=False)
        _ = rows | "Large" >> ClassifyText(task=_task(instructions="Sort the ticket."), model=model,
                                           max_prefix_cache_mb=64, threads=2, verify=False)
        p.run().wait_until_finish()
    finally:
        torch.set_num_threads(threads)
    holder = ModelHolder.last
    # (pools are keyed by step and bound: a later pipeline's same-named step with another bound gets its own)
    assert {key.split("|")[0]: pool.max_bytes for key, pool in holder.pools.items()} == \
        {"Small": 2**20, "Large": 64 * 2**20}
    assert {step for step, _ in seen} == {"Small", "Large"}
    assert all(n == {"Small": 1, "Large": 2}[step] for step, n in seen), seen
