"""`pipelines.fit` with no feature flags chooses the head's features by folds (#55.1): a few
candidates read by one feature pass (each candidate's slice equal to its own forward, and
cached equal to full re-encoding), fit on the same folds, timed on this machine, the most
accurate or the cheapest within `--prefer`'s margin kept; the summary, the console and the
head file say what was compared and chosen; explicit --layers/--pooling skip it, and
--dtype names the precision it searches in, which the head records and a classifier given
no dtype then runs in (#56.7: another is refused where it is built)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from beam_prefix import PrefixClassifier, TaskSpec
from beam_prefix.engines.feature_search import Candidate, candidates, choose, slice_features, time_candidates, union
from beam_prefix.tasks.trained_head import TrainedHead
from beam_prefix.pipelines import fit

from conftest import ROOT, TEXTS, tiny_task

SAMPLE = os.path.join(ROOT, "pipelines", "data", "sample_tickets.csv")


def test_the_candidates_are_the_issues_for_the_embedded_models_depth_and_fit_a_shallow_one():
    assert [(c.layers, c.pooling) for c in candidates(30)] == [((1,), "mean"), ((6,), "mean"), ((6, 12), "mean"),
                                                               ((-1,), "last")]
    assert union(candidates(30)) == ((1, 6, 12, -1), "last+mean")
    assert [(c.layers, c.pooling) for c in candidates(3)] == [((1,), "mean"), ((1, 2), "mean"), ((-1,), "last")]
    assert [c.layers for c in candidates(1)] == [(-1,)]  # (layer 1 of 1 is the final state)


@pytest.mark.parametrize("arch", ["llama", "qwen2_sliding", "gpt2"])
def test_each_candidates_slice_of_one_pass_is_its_own_forward_and_cached_equals_full(tiny_models, arch):
    clf = PrefixClassifier(task=tiny_task(), loaded=tiny_models[arch], verify=False)
    found = candidates(3)
    layers, pooling = union(found)
    both = np.asarray([e.features for e in clf.embed(TEXTS, layers=layers, pooling=pooling)])
    full = np.asarray([e.features for e in clf.embed_full(TEXTS, layers=layers, pooling=pooling)])
    np.testing.assert_allclose(both, full, atol=1e-4)  # the one pass: cached == re-encoding
    for c in found:
        alone = np.asarray([e.features for e in clf.embed(TEXTS, layers=c.layers, pooling=c.pooling)])
        np.testing.assert_allclose(slice_features(both, layers, c), alone, atol=1e-5, err_msg=c.name)


def test_choose_keeps_the_cheapest_within_the_margin_of_the_best():
    a, b, c = Candidate((1,), "mean"), Candidate((6,), "mean"), Candidate((-1,), "last")
    accuracy = {a: 0.910, b: 0.914, c: 0.916}
    cost = {a: 1.0, b: 4.0, c: 20.0}
    assert choose(accuracy, cost, "accuracy") == c
    assert choose(accuracy, cost, "balanced") == b  # 0.914 is within 0.5 points of 0.916
    assert choose(accuracy, cost, "cost") == a


def test_fit_with_no_feature_flags_compares_the_candidates_from_one_pass(tiny_dir, tmp_path, monkeypatch, capsys):
    built = []
    real = fit.EmbedText

    def recorded(**kwargs):
        built.append((tuple(kwargs["layers"]), kwargs["pooling"]))
        return real(**kwargs)

    monkeypatch.setattr(fit, "EmbedText", recorded)
    assert fit.main(["--runner=DirectRunner", f"--model={tiny_dir}", f"--input={SAMPLE}", "--label_column=label",
                     f"--output={tmp_path}/h.head", f"--summary_output={tmp_path}/s.json", "--verify=false",
                     "--folds=3"]) == 0
    assert built == [((1, 2, -1), "last+mean")]  # one feature pass for every candidate
    s = json.loads((tmp_path / "s.json").read_text())
    rows = s["candidates"]  # each feature set without and with the task's label rows (--label_rows auto)
    assert [(r["layers"], r["pooling"], r["label_rows"]) for r in rows] == [
        (layers, pooling, with_rows) for layers, pooling in (([1], "mean"), ([1, 2], "mean"), ([-1], "last"))
        for with_rows in (False, True)]
    for r in rows:
        assert r["dtype"] == "float32" and 0 <= r["fold_accuracy"] <= 1 and r["ms_per_row"] > 0
        assert r["ngrams"] == (r["lexical_alpha"] > 0)
    best = max(r["fold_accuracy"] for r in rows)
    chosen = s["chosen"]
    assert chosen["prefer"] == "balanced" and (s["layers"], s["pooling"]) == (chosen["layers"], chosen["pooling"])
    near = [r for r in rows if r["fold_accuracy"] >= best - 0.005]
    pick = min(near, key=lambda r: (r["ms_per_row"], -r["fold_accuracy"]))
    assert (pick["layers"], pick["label_rows"]) == (chosen["layers"], chosen["label_rows"])
    head = TrainedHead.load(tmp_path / "h.head")
    assert list(head.layers) == chosen["layers"] and head.pooling == chosen["pooling"]
    assert ("label_rows" in head.metrics) == chosen["label_rows"]
    assert head.metrics["feature_search"]["chosen"] == chosen  # the head file records it
    printed = capsys.readouterr().out
    assert "features chosen by folds" in printed and "* layers" in printed
    # the head answers where it was fit
    task = TaskSpec.from_yaml(os.path.join(ROOT, "pipelines", "tasks", "support_tickets.yaml"))
    PrefixClassifier.check_fits(task.replace(scoring="head", head=head, calibration=False), tiny_dir)


@pytest.mark.parametrize("flag", ["--layers=-1", "--pooling=mean"])
def test_an_explicit_feature_flag_skips_the_search(flag, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("beam_prefix.pipelines.fit_search.ms_per_row", lambda *a, **k: pytest.fail("searched"))
    summary = fit.run(["--runner=DirectRunner", f"--model={tiny_dir}", f"--input={SAMPLE}", "--label_column=label",
                       f"--output={tmp_path}/h.head", "--verify=false", "--folds=3", flag])
    assert "candidates" not in summary and summary["layers"] == [-1]
    assert summary["pooling"] == ("mean" if flag == "--pooling=mean" else "last")


def test_dtype_searches_in_that_precision_and_the_head_carries_it_to_classify(tiny_dir, tmp_path):
    from beam_prefix.transforms import ClassifyText
    from beam_prefix.beam.handler import PrefixCachedModelHandler

    summary = fit.run(["--runner=DirectRunner", f"--model={tiny_dir}", f"--input={SAMPLE}", "--label_column=label",
                       f"--output={tmp_path}/h.head", "--verify=false", "--folds=3", "--dtype=bfloat16"])
    assert summary["candidates"] and {r["dtype"] for r in summary["candidates"]} == {"bfloat16"}
    head = TrainedHead.load(tmp_path / "h.head")
    assert head.dtype == "bfloat16"
    task = TaskSpec.from_yaml(os.path.join(ROOT, "pipelines", "tasks", "support_tickets.yaml"))
    task = task.replace(scoring="head", head=head, calibration=False, model=tiny_dir)
    # no dtype: the head's; its fingerprint check (which refuses another precision) passes
    assert ClassifyText(task=task).config.dtype == "bfloat16"
    assert PrefixCachedModelHandler(task=task)._dtype == "bfloat16"
    clf = PrefixClassifier.load(task, verify=False)
    assert clf.model_id and [p.label for p in clf.classify(TEXTS[:2])][0] in task.label_names
    # another precision named: refused where the step is built, naming both
    for build in (lambda: ClassifyText(task=task, dtype="float32"),
                  lambda: PrefixCachedModelHandler(task=task, dtype="float32"),
                  lambda: PrefixClassifier.load(task, dtype="float32", verify=False)):
        with pytest.raises(ValueError, match="fit in bfloat16"):
            build()


def test_a_head_without_a_recorded_dtype_runs_in_float32(tiny_dir, tmp_path):
    """Heads written before heads recorded their precision (the fields absent) keep
    today's default, float32, and are checked as float32 (#61.16): another dtype is refused
    where the step is built, naming both."""
    from beam_prefix.transforms import ClassifyText
    from beam_prefix import fit_head
    from beam_prefix.model import load_model
    from beam_prefix.tasks.trained_head import dtype_for

    clf = PrefixClassifier(task=tiny_task(), loaded=load_model(tiny_dir), verify=False)
    names = clf.task.label_names
    head = fit_head(clf, TEXTS * 2, [names[i % len(names)] for i in range(len(TEXTS) * 2)], folds=2)
    assert head.dtype == "float32"
    head.dtype = None
    head.save(tmp_path / "old.head")
    old = TrainedHead.load(tmp_path / "old.head")
    assert old.dtype is None and dtype_for([old], None) == "float32" and dtype_for([old], "float32") == "float32"
    with pytest.raises(ValueError, match=r"dtype='bfloat16', but head .* was fit in float32 \(it records no precision"):
        dtype_for([old], "bfloat16")
    task = clf.task.replace(scoring="head", head=old, model=tiny_dir)
    assert ClassifyText(task=task).config.dtype == "float32"
    with pytest.raises(ValueError, match="different dtypes"):
        dtype_for([old, _as(head, "float32"), _as(head, "bfloat16")], None)


def _as(head, dtype):
    import copy

    other = copy.copy(head)
    other.dtype = dtype
    return other


def test_candidates_are_timed_by_their_least_disturbed_round():
    """#64.3: a process waking up during one round must not reorder the candidates' costs,
    so each keeps its best of interleaved rounds (a round can only be slowed, never sped)."""
    cheap, dear = Candidate((1,), "mean"), Candidate((6,), "mean")
    calls = {cheap: 0, dear: 0}
    busy = {(cheap, 2): 0.08, (cheap, 3): 0.08}  # the cheap candidate's 2nd and 3rd calls hit a busy machine

    def embed(c):
        calls[c] += 1
        time.sleep((0.01 if c == cheap else 0.03) + busy.get((c, calls[c]), 0.0))

    costs = time_candidates(embed, [cheap, dear], rounds=3)
    assert costs[cheap] < costs[dear]  # (a median would have put the cheap one above the dear one)
    assert 10 <= costs[cheap] < 90 and costs[dear] >= 30  # (its undisturbed round; sleeps only overshoot)


def test_auto_searches_bf16_beside_float32_where_it_is_native_and_the_head_records_the_chosen(
        tiny_dir, tmp_path, monkeypatch, capsys):
    """#64.2: with --dtype auto (the default) on a CPU with native bf16, every candidate is fit
    and timed in both precisions on the same rows and folds; the choice ranges over all of
    them, each summary entry names its precision and label rows, and the head records the
    precision chosen, in which classify then runs (another is refused)."""
    from beam_prefix.transforms import ClassifyText

    monkeypatch.setattr("beam_prefix.pipelines.fit_search.native_bf16", lambda: True)
    assert fit.main(["--runner=DirectRunner", f"--model={tiny_dir}", f"--input={SAMPLE}", "--label_column=label",
                     f"--output={tmp_path}/h.head", f"--summary_output={tmp_path}/s.json", "--verify=false",
                     "--folds=3"]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    rows = s["candidates"]
    assert {(r["dtype"], r["label_rows"]) for r in rows} == {(d, w) for d in ("float32", "bfloat16")
                                                            for w in (False, True)}
    assert len(rows) == 2 * 2 * 3 and all(r["ms_per_row"] > 0 and r["fold_accuracy"] is not None for r in rows)
    chosen = s["chosen"]
    assert chosen["precisions"] == ["float32", "bfloat16"] and "natively" in chosen["precisions_why"]
    best = max(r["fold_accuracy"] for r in rows)
    pick = min((r for r in rows if r["fold_accuracy"] >= best - 0.005), key=lambda r: (r["ms_per_row"], -r["fold_accuracy"]))
    assert (pick["layers"], pick["label_rows"], pick["dtype"]) == (chosen["layers"], chosen["label_rows"], chosen["dtype"])
    head = TrainedHead.load(tmp_path / "h.head")
    assert head.dtype == chosen["dtype"] == s["dtype"]
    assert "precision" in capsys.readouterr().out
    task = TaskSpec.from_yaml(os.path.join(ROOT, "pipelines", "tasks", "support_tickets.yaml"))
    task = task.replace(scoring="head", head=head, calibration=False, model=tiny_dir)
    assert ClassifyText(task=task).config.dtype == head.dtype
    other = "float32" if head.dtype == "bfloat16" else "bfloat16"
    with pytest.raises(ValueError, match=f"fit in {head.dtype}"):
        ClassifyText(task=task, dtype=other)


def test_which_precisions_a_fit_compares(monkeypatch):
    from beam_prefix.pipelines.fit_search import precisions

    monkeypatch.setattr("beam_prefix.pipelines.fit_search.native_bf16", lambda: False)
    assert precisions(None, "cpu", True)[0] == precisions("auto", "cpu", True)[0] == ["float32"]
    assert "no native bf16" in precisions("auto", "cpu", True)[1]
    assert precisions("bfloat16", "cpu", True)[0] == ["bfloat16"]  # named: that one alone
    assert precisions("auto", "cuda", True)[0] == ["float32", "bfloat16"]
    monkeypatch.setattr("beam_prefix.pipelines.fit_search.native_bf16", lambda: True)
    assert precisions("auto", "cpu", True)[0] == ["float32", "bfloat16"]
    assert precisions("auto", "cpu", False)[0] == ["float32"]  # named features: float32, said why
    assert "--layers" in precisions("auto", "cpu", False)[1]


def test_auto_elsewhere_is_the_heads_precision(tiny_dir):
    from apache_beam.options.pipeline_options import PipelineOptions

    from beam_prefix.pipelines.options import classify_transform, validate

    options = PipelineOptions([f"--model={tiny_dir}", "--task=support_tickets", "--dtype=auto"])
    validate(options)
    assert classify_transform(options).config.dtype == "float32"
