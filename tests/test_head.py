"""Trained heads: the features they read equal full re-encoding's, head scoring equals its
no-cache reference, the head file, the errors that protect it, `EmbedText`, and
`pipelines.fit` through its command line (tiny random models; the embedded model for the
features' exactness)."""

from __future__ import annotations

import json
import os

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_prefix import PrefixClassifier, TaskSpecError
from beam_prefix.beam.embed_transform import EmbedText
from beam_prefix.engines.head_fitting import C_GRID
from beam_prefix.tasks.lexical_head import ALPHAS
from beam_prefix.tasks.trained_head import TrainedHead, feature_fingerprint, text_hash
from beam_prefix.pipelines import classify, fit

from conftest import ARCHS, SUPPORT_TASK, TEXTS, assert_same_predictions, tiny_task

LABELS = ("billing", "technical", "account")
# the support task's sample: 60 labelled tickets, 20 per label (the training rows here)
SAMPLE = os.path.join(os.path.dirname(__file__), "..", "pipelines", "data", "sample_tickets.csv")


def _features_task():
    return tiny_task()  # calibration off, scored the plain way: what features are read after


def _head_for(clf: PrefixClassifier, layers=(-1,), seed=0, pooling="last") -> TrainedHead:
    """A head over `clf`'s features (random weights: exactness does not need a good head)."""
    gen = torch.Generator().manual_seed(seed)
    width = len(clf.embed(["x"], layers=layers)[0].features)
    return TrainedHead(labels=clf.task.label_names, layers=layers, weight=torch.randn(3, width, generator=gen),
                       bias=torch.randn(3, generator=gen), mean=torch.randn(width, generator=gen) * 0.1,
                       std=torch.rand(width, generator=gen) + 0.5,
                       fingerprint=feature_fingerprint(clf.features_fingerprint, torch.float32, layers, pooling),
                       train_hashes=[text_hash(TEXTS[0])], pooling=pooling)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("engine", ["shared", "expanded"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_cached_features_equal_full_reencoding(tiny_models, arch, engine, pooling):
    clf = PrefixClassifier(task=_features_task(), loaded=tiny_models[arch], verify=False, batch_size=7,
                           prefix_attention=engine)
    layers = (-1, 1)
    cached = clf.embed(TEXTS, layers=layers, pooling=pooling)
    full = clf.embed_full(TEXTS, layers=layers, pooling=pooling)
    diff = max(abs(a - b) for c, f in zip(cached, full) for a, b in zip(c.features, f.features))
    assert diff < 1e-4, f"max feature difference {diff:.2e}"
    spread = np.ptp(np.array([c.features for c in cached]), axis=0).max()
    assert spread > 100 * max(diff, 1e-7)  # the features depend on the text
    assert clf.cache_length() == clf.prefix_length


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_cached_features_equal_full_reencoding_on_the_embedded_model(embedded, pooling):
    clf = PrefixClassifier(task=_features_task(), loaded=embedded, verify=False, batch_size=5)
    cached = clf.embed(TEXTS[:9], layers=(-1, 20), pooling=pooling)
    full = clf.embed_full(TEXTS[:9], layers=(-1, 20), pooling=pooling)
    diff = max(abs(a - b) for c, f in zip(cached, full) for a, b in zip(c.features, f.features))
    assert diff < 1e-3, f"max feature difference {diff:.2e}"  # 576 x 2 values per row, fp32
    if pooling == "mean":  # the mean is not the last position's state
        last = clf.embed(TEXTS[:9], layers=(-1, 20))
        assert max(abs(a - b) for c, f in zip(cached, last) for a, b in zip(c.features, f.features)) > 1.0


@pytest.mark.parametrize("arch,pooling", [("llama", "last"), ("qwen2_sliding", "last"), ("gpt2", "last"),
                                          ("llama", "mean"), ("mistral_sliding", "mean")])
def test_head_scoring_equals_its_reference_and_self_checks(tiny_models, arch, pooling):
    loaded = tiny_models[arch]
    base = PrefixClassifier(task=_features_task(), loaded=loaded, verify=False)
    head = _head_for(base, layers=(-1, 2), pooling=pooling)
    assert head.pooling == pooling
    clf = PrefixClassifier(task=base.task.replace(scoring="head", head=head), loaded=loaded, verify=True, batch_size=5)
    assert clf.mode == "head" and clf.label_tokens == 0
    cached = clf.classify_encoded([clf.encode(t) for t in TEXTS], features=True)
    assert_same_predictions(cached, clf.classify_full(TEXTS))
    assert all(p.label_tokens == 0 for p in cached)
    # a head is part of what shapes the outputs: the fingerprint differs from the plain task's
    assert clf.fingerprint != base.fingerprint and clf.features_fingerprint == base.fingerprint
    # the features a prediction carries are the row's features, from the same pass
    embedded = clf.embed(TEXTS, layers=(-1, 2), pooling=pooling)
    assert all(np.allclose(p.features, e.features, atol=1e-5) for p, e in zip(cached, embedded))


def test_head_file_round_trip_and_the_errors_that_protect_it(tiny_models, tmp_path):
    loaded = tiny_models["llama"]
    base = PrefixClassifier(task=_features_task(), loaded=loaded, verify=False)
    head = _head_for(base)
    path = tmp_path / "t.head"
    head.save(path)
    again = TrainedHead.load(path)
    assert again.identity == head.identity and again.labels == LABELS and again.trained_on(TEXTS[0])
    assert not again.trained_on(TEXTS[1])
    task = base.task.replace(scoring="head", head=str(path))
    assert isinstance(task.head, TrainedHead)
    with pytest.raises(TaskSpecError, match="calibration does not apply"):
        base.task.replace(scoring="head", head=head, calibration=True)
    with pytest.raises(TaskSpecError, match="scoring: head needs a head"):
        base.task.replace(scoring="head")
    with pytest.raises(TaskSpecError, match="used with scoring: head"):
        base.task.replace(head=head)
    with pytest.raises(TaskSpecError, match="was fit for labels"):
        tiny_task(("spam", "ham", "other")).replace(scoring="head", head=head)
    with pytest.raises(TaskSpecError, match="does not exist"):
        base.task.replace(scoring="head", head=str(tmp_path / "missing.head"))
    (tmp_path / "bad.head").write_bytes(b"not a head")
    with pytest.raises(TaskSpecError, match="is not a beam-prefix head"):
        base.task.replace(scoring="head", head=str(tmp_path / "bad.head"))
    # fit on one model, used on another: refused, naming both fingerprints
    with pytest.raises(TaskSpecError, match=f"was fit on features {head.fingerprint}.*tiny-qwen2_sliding"):
        PrefixClassifier(task=task, loaded=tiny_models["qwen2_sliding"], verify=False)


def test_a_task_file_reads_its_head_relative_to_itself(tiny_models, tmp_path):
    base = PrefixClassifier(task=_features_task(), loaded=tiny_models["llama"], verify=False)
    _head_for(base).save(tmp_path / "support.head")
    text = open(SUPPORT_TASK, encoding="utf-8").read().replace("calibration: true", "calibration: false")
    (tmp_path / "task.yaml").write_text(text.replace("scoring: auto", "scoring: head\nhead: support.head"))
    from beam_prefix import TaskSpec

    task = TaskSpec.from_yaml(tmp_path / "task.yaml")
    assert task.head.source == str(tmp_path / "support.head")


def test_embed_text_step_on_dict_and_schemad_rows(tiny_dir):
    from beam_prefix.model.loading import load_model

    clf = PrefixClassifier(task=_features_task(), loaded=load_model(tiny_dir), verify=False)
    reference = {t: e.features for t, e in zip(TEXTS[:5], clf.embed_full(TEXTS[:5], layers=(-1, 2)))}

    def close(row):
        row = row if isinstance(row, dict) else row.as_dict()
        return row["id"], bool(np.allclose(row["features"], reference[row["text"]], atol=1e-4))

    with TestPipeline() as p:
        dicts = p | "Dicts" >> beam.Create([{"id": i, "text": t} for i, t in enumerate(TEXTS[:5])] + [{"id": 9}])
        rows = p | "Rows" >> beam.Create([beam.Row(id=i, text=t) for i, t in enumerate(TEXTS[:5])])
        for name, pcoll in (("D", dicts), ("R", rows)):
            out = pcoll | f"Embed{name}" >> EmbedText(task=_features_task(), model=tiny_dir, layers=(-1, 2),
                                                      id_column="id", verify=False)
            assert_that(out.embedded | f"Close{name}" >> beam.Map(close), equal_to([(i, True) for i in range(5)]),
                        label=f"Embedded{name}")
        assert_that(out.failed, equal_to([]), label="NoneFailedR")


def _no_model(monkeypatch):
    monkeypatch.setattr("beam_prefix.beam.worker.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


@pytest.mark.parametrize("rows,message", [
    ([("T1", "app crashes", "billing"), ("T2", "refund", "shipping")], "labels the task 'support_tickets' lacks"),
    ([("T1", "app crashes", "billing"), ("T2", "refund", "technical")], "labels with no training row: ['account']"),
    ([("T1", "app crashes", "billing")], "labels with no training row"),  # one class
])
def test_fit_refuses_bad_labels_before_any_model_work(tmp_path, monkeypatch, capsys, rows, message):
    _no_model(monkeypatch)
    csv = tmp_path / "in.csv"
    csv.write_text("id,text,label\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    assert fit.main(["--runner=DirectRunner", f"--input={csv}", "--label_column=label",
                     f"--output={tmp_path}/t.head"]) == 2
    err = capsys.readouterr().err
    assert message in err and "\n" not in err.strip()
    assert not os.path.exists(tmp_path / "t.head")


def test_fit_then_classify_through_the_command_line(tiny_dir, tmp_path, capsys):
    """The README's two commands on the tiny model: fit on the sample tickets, classify with
    the head; rows the head was fit on are left out of the reported accuracy."""
    head = tmp_path / "support.head"
    assert fit.main(["--runner=DirectRunner", "--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
                     f"--output={head}", f"--model={tiny_dir}", "--verify=false", "--layers", "-1,2", "--folds=3",
                     "--pooling=mean"]) == 0
    out = capsys.readouterr().out
    assert f"head written: {head}" in out and "rows: 60 used, 0 failed" in out and "3-fold accuracy" in out
    trained = TrainedHead.load(head)
    assert trained.layers == (-1, 2) and trained.pooling == "mean"
    # (--label_rows auto: the task's label rows' hashes join the rows' when the folds kept them)
    assert trained.metrics["train_rows"] == 60
    assert len(trained.train_hashes) == 60 + trained.metrics.get("label_rows", 0)
    assert set(trained.metrics["per_label_f1"]) == set(LABELS) and trained.metrics["C"] in C_GRID

    text = open(SUPPORT_TASK, encoding="utf-8").read().replace("calibration: true", "calibration: false")
    (tmp_path / "task.yaml").write_text(text.replace("scoring: auto", "scoring: head\nhead: support.head"))
    mixed = tmp_path / "mixed.csv"  # 5 rows the head was fit on, 4 it never saw
    import csv as csv_module

    with open(SAMPLE, encoding="utf-8") as f:
        sample = list(csv_module.DictReader(f))[:5]
    unseen = [{"ticket_id": f"U{i}", "text": t, "label": "technical"} for i, t in enumerate(TEXTS[10:14])]
    with open(mixed, "w", newline="", encoding="utf-8") as f:
        writer = csv_module.DictWriter(f, fieldnames=["ticket_id", "text", "label"])
        writer.writeheader()
        writer.writerows([{k: r[k] for k in ("ticket_id", "text", "label")} for r in sample] + unseen)
    summary = classify.run(["--runner=DirectRunner", f"--task={tmp_path}/task.yaml", f"--input={mixed}",
                            f"--model={tiny_dir}", "--eval_label_column=label", f"--output={tmp_path}/out/",
                            "--verify=false", "--output_features=true"])
    ev = summary["evaluation"]
    assert (ev["rows"], ev["fit_rows_left_out"], summary["labeled"]) == (4, 5, 9)
    assert "that did not fit the head (5 rows that fit it left out)" in capsys.readouterr().out
    table = pq.read_table(next(p for p in (tmp_path / "out").iterdir() if p.name.startswith("labeled-0")))
    assert table.schema.field("features").type == pa.list_(pa.float32())
    assert all(len(v) == trained.features for v in table.column("features").to_pylist())
    assert json.load(open(tmp_path / "out" / "labeled-summary.json"))["evaluation"]["rows"] == 4


@pytest.mark.parametrize("task", ["support_tickets_head", "banking77_head", "banking77_fast_head"])
def test_the_shipped_heads_fit_the_shipped_prompts_and_model(embedded, task):
    """A shipped head is used with the prompt and model it was fit on: a changed task file
    or model would refuse it here, not in a user's run. The self-check compares its
    probabilities cached vs full."""
    from beam_prefix import TaskSpec

    spec = TaskSpec.from_yaml(os.path.join(os.path.dirname(__file__), "..", "pipelines", "tasks", f"{task}.yaml"))
    clf = PrefixClassifier(task=spec, loaded=embedded, verify=True, batch_size=8)
    assert clf.mode == "head" and spec.head.metrics["kfold_accuracy"] >= 0.8
    assert 0 < len(spec.head.train_hashes) <= spec.head.metrics["train_rows"]  # (duplicate texts hash once)


def test_fit_head_inside_one_program_as_the_readme_shows(tiny_models):
    """`beam_prefix.fit_head`: features by the classifier's own cached engine, a head that
    the classifier's task then answers with (its self-check passing), its training rows known."""
    import csv as csv_module

    from beam_prefix import fit_head

    with open(SAMPLE, encoding="utf-8") as f:
        sample = list(csv_module.DictReader(f))
    clf = PrefixClassifier(task=tiny_task(calibration=True), loaded=tiny_models["llama"], verify=False)
    head = fit_head(clf, [r["text"] for r in sample], [r["label"] for r in sample], layers=(-1, 2), folds=3)
    assert head.layers == (-1, 2) and head.metrics["train_rows"] == 60 and head.trained_on(sample[0]["text"])
    task = clf.task.replace(scoring="head", head=head, calibration=False)
    answered = PrefixClassifier(task=task, loaded=tiny_models["llama"], verify=True)
    assert answered.mode == "head" and answered.classify(["refund please"])[0].label in LABELS
    with pytest.raises(ValueError, match="labels with no training row"):
        fit_head(clf, ["a", "b"], ["billing", "technical"])


def test_fit_on_the_portable_runners_subprocess_workers_gives_the_direct_runners_head(tiny_dir, tmp_path):
    """#34.3: the features are computed by worker processes of the portable runner (the
    path Flink and Dataflow Runner v2 take), staged beside the head where those workers
    write them, read back by the launcher: the head equals the DirectRunner's, and the
    summary JSON lands at --summary_output."""
    import sys

    common = ["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label", f"--model={tiny_dir}",
              "--verify=false", "--layers=-1,2", "--folds=3"]
    direct = fit.run(["--runner=DirectRunner", *common, f"--output={tmp_path}/direct/support.head"])
    portable = fit.run(["--runner=PortableRunner", "--job_endpoint=embed",
                        "--environment_type=beam:env:harness_subprocess_python:v1",
                        f"--environment_config={sys.executable} -m apache_beam.runners.worker.sdk_worker_main",
                        *common, f"--output={tmp_path}/portable/support.head",
                        f"--summary_output={tmp_path}/portable/fit-summary.json"])
    a, b = TrainedHead.load(tmp_path / "direct" / "support.head"), TrainedHead.load(tmp_path / "portable" / "support.head")
    assert (direct["rows_used"], portable["rows_used"]) == (60, 60)
    assert sorted(a.train_hashes) == sorted(b.train_hashes) and a.fingerprint == b.fingerprint
    assert a.metrics["C"] == b.metrics["C"] and a.metrics["kfold_accuracy"] == b.metrics["kfold_accuracy"]
    assert torch.allclose(a.weight, b.weight, atol=1e-3) and torch.allclose(a.mean, b.mean, atol=1e-4)
    assert json.load(open(tmp_path / "portable" / "fit-summary.json"))["rows_used"] == 60
    assert sorted(os.listdir(tmp_path / "portable")) == ["fit-summary.json", "support.head"]  # staging removed


@pytest.mark.parametrize("flag", ["--output_table=p:d.t", "--failed_output=x/failed", "--output_format=jsonl",
                                  "--columns_to_keep=text"])
def test_fit_refuses_the_row_output_flags_it_would_ignore(tmp_path, capsys, flag):
    code = fit.main(["--runner=DirectRunner", f"--input={SAMPLE}", "--label_column=label",
                     f"--output={tmp_path}/h.head", flag])
    assert code == 2 and f"{flag.split('=')[0]} does not apply to pipelines.fit" in capsys.readouterr().err


def test_fit_honours_max_text_tokens_and_overflow(tiny_dir, tmp_path):
    """--max_text_tokens/--overflow were ignored by fit: rows over the budget now fail as
    they would in classify, and the head is fit on the rest."""
    summary = fit.run(["--runner=DirectRunner", f"--input={SAMPLE}", "--label_column=label", f"--model={tiny_dir}",
                       "--verify=false", "--max_text_tokens=12", "--overflow=reject", "--folds=2",
                       f"--output={tmp_path}/h.head"])
    assert summary["rows_failed"] > 0 and summary["rows_used"] + summary["rows_failed"] == 60


# -- words beside hidden states (#35) -------------------------------------------------------

def _lexical_rows():
    """Rows whose label is in their words, not in what a tiny random model makes of them."""
    import random

    rng = random.Random(7)
    cues = {"billing": ["invoice", "refund", "charged twice"], "technical": ["crash", "error code", "freezes"],
            "account": ["password", "login", "username"]}
    filler = ["please help", "today", "again", "my team says", "since monday", "urgent"]
    rows = []
    for label, words in cues.items():
        for i in range(20):
            rows.append((f"{rng.choice(filler)} {rng.choice(words)} {rng.choice(filler)} {i}", label))
    rng.shuffle(rows)
    return rows


def test_a_head_that_reads_words_is_weighed_by_its_folds_and_stays_exact(tiny_models, tmp_path):
    """fit_head fits the n-gram part and weighs it by the folds (here the words carry the
    label: a weight > 0 and a better fold accuracy than the hidden states alone); cached
    == full re-encoding with it (the self-check passes); the file keeps it exactly."""
    from beam_prefix import fit_head

    loaded = tiny_models["llama"]
    rows = _lexical_rows()
    base = PrefixClassifier(task=_features_task(), loaded=loaded, verify=False)
    head = fit_head(base, [t for t, _ in rows], [g for _, g in rows], layers=(-1,), folds=3)
    assert head.lexical is not None and head.lexical.alpha in ALPHAS[1:]
    assert head.metrics["kfold_accuracy"] > head.metrics["kfold_accuracy_hidden_states"]
    assert "n-grams" in repr(head)
    clf = PrefixClassifier(task=base.task.replace(scoring="head", head=head), loaded=loaded, verify=True, batch_size=4)
    texts = ["my invoice shows a refund missing", "the app crashes with an error code", "forgot my password"]
    cached, full = clf.classify(texts), clf.classify_full(texts)
    assert_same_predictions(cached, full)
    assert [p.label for p in cached] == ["billing", "technical", "account"]
    # the evidence is what the head adds: without it the same rows score otherwise
    plain = PrefixClassifier(task=base.task.replace(scoring="head", head=TrainedHead(
        labels=head.labels, layers=head.layers, weight=head.weight, bias=head.bias, mean=head.mean, std=head.std,
        fingerprint=head.fingerprint)), loaded=loaded, verify=False)
    assert any(abs(a.score - b.score) > 1e-3 for a, b in zip(cached, plain.classify(texts)))
    head.save(tmp_path / "w.head")
    again = TrainedHead.load(tmp_path / "w.head")
    assert again.identity == head.identity and again.lexical.alpha == head.lexical.alpha
    reread = PrefixClassifier(task=base.task.replace(scoring="head", head=again), loaded=loaded, verify=False)
    assert [p.scores for p in reread.classify(texts)] == [p.scores for p in cached]


def test_words_that_do_not_help_get_no_weight(tiny_models):
    """Every label's rows have the same words (one text, labels in turn): the n-grams add
    nothing in any fold, the tie goes to the fewer n-grams, weight 0, and the head has no
    lexical part; lexical=False fits none at all."""
    from beam_prefix import fit_head

    texts = ["the same words for every label"] * 30
    labels = [LABELS[i % 3] for i in range(30)]
    base = PrefixClassifier(task=_features_task(), loaded=tiny_models["llama"], verify=False)
    head = fit_head(base, texts, labels, folds=3)
    by_alpha = head.metrics["kfold_accuracy_by_lexical_alpha"]
    assert len(set(by_alpha.values())) == 1 and head.metrics["lexical_alpha"] == 0.0 and head.lexical is None
    assert "kfold_accuracy_hidden_states" not in fit_head(base, texts, labels, folds=3, lexical=False).metrics


def test_damaged_lexical_parts_are_refused(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    from beam_prefix import fit_head

    rows = _lexical_rows()
    base = PrefixClassifier(task=_features_task(), loaded=tiny_models["llama"], verify=False)
    head = fit_head(base, [t for t, _ in rows], [g for _, g in rows], folds=3)
    head.save(tmp_path / "w.head")
    tensors = load_file(tmp_path / "w.head")
    with safe_open(tmp_path / "w.head", framework="pt") as f:
        meta = f.metadata()
    for name, change, message in (
            ("lexical_weight", lambda t: t.fill_(float("nan")), "not finite"),
            ("lexical_word_columns", lambda t: t.fill_(-3), "columns outside"),
            ("lexical_bias", lambda t: t[:1], "do not fit")):
        broken = dict(tensors)
        broken[name] = change(broken[name].clone())
        save_file(broken, tmp_path / "bad.head", metadata=meta)
        with pytest.raises(TaskSpecError, match=message):
            TrainedHead.load(tmp_path / "bad.head")
    missing = {k: v for k, v in tensors.items() if k != "lexical_char_idf"}
    save_file(missing, tmp_path / "bad.head", metadata=meta)
    with pytest.raises(TaskSpecError, match="lacks \\['lexical_char_idf'\\]"):
        TrainedHead.load(tmp_path / "bad.head")


def test_a_two_label_head_fits_and_answers(tiny_models):
    """scikit-learn gives a two-class regression one row of weights: the head (and its
    n-gram part) turn it into the two labels' logits, so a 2-label task can have a head."""
    from beam_prefix import fit_head

    rows = [(t, "billing" if g == "billing" else "other") for t, g in _lexical_rows()]
    task = tiny_task(("billing", "other"), calibration=False)
    base = PrefixClassifier(task=task, loaded=tiny_models["llama"], verify=False)
    head = fit_head(base, [t for t, _ in rows], [g for _, g in rows], folds=3)
    assert head.weight.shape[0] == 2 and (head.lexical is None or head.lexical.weight.shape[0] == 2)
    clf = PrefixClassifier(task=task.replace(scoring="head", head=head), loaded=tiny_models["llama"], verify=True)
    assert clf.classify(["please refund my invoice"])[0].label == "billing"


def test_out_of_fold_equals_scikit_learns_and_label_rows_only_ever_train():
    """`out_of_fold` is `cross_val_predict` where every row is held out once (the shipped
    heads' folds are unchanged); rows past the held-out ones train every split, and no
    split ever holds them out or scores them."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    from beam_prefix.tasks.lexical_head import out_of_fold

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 5)), np.arange(40) % 3
    x[:, 0] += y
    cv = StratifiedKFold(n_splits=4, shuffle=True, random_state=0)
    splits = list(cv.split(x, y))
    model = LogisticRegression(C=1.0, max_iter=2000)
    assert np.allclose(out_of_fold(model, x, y, splits, 3),
                       cross_val_predict(model, x, y, cv=cv, method="predict_log_proba"))
    extra = np.arange(40, 43)
    xe, ye = np.concatenate([x, 5 * np.eye(3, 5)]), np.concatenate([y, [0, 1, 2]])
    with_extra = out_of_fold(model, xe, ye, [(np.concatenate([t, extra]), h) for t, h in splits], 3)
    assert with_extra.shape == (40, 3)  # the held-out rows only
    assert not np.allclose(with_extra, out_of_fold(model, x, y, splits, 3))  # the extra rows trained


def test_a_head_may_also_learn_from_the_tasks_own_label_rows(tiny_models, tmp_path):
    """label_rows: each label's name (and description) trains the head beside the rows;
    the fold accuracy is over the labelled rows only, the label texts count as rows it was
    fit on, and the head stays exact (its self-check passes)."""
    from beam_prefix import TaskSpec, fit_head
    from beam_prefix.engines.head_fitting import task_label_rows

    task = TaskSpec.from_dict({"name": "t", "labels": [{"name": "billing", "description": "invoices and refunds"},
                                                       "technical", "account_access"]})
    assert task_label_rows(task) == (["billing", "invoices and refunds", "technical", "account access"],
                                     ["billing", "billing", "technical", "account_access"])
    rows = _lexical_rows()
    loaded = tiny_models["llama"]
    base = PrefixClassifier(task=_features_task(), loaded=loaded, verify=False)
    texts, labels = [t for t, _ in rows], [g for _, g in rows]
    plain = fit_head(base, texts, labels, layers=(-1,), folds=3)
    taught = fit_head(base, texts, labels, layers=(-1,), folds=3, label_rows=True)
    assert taught.metrics["label_rows"] == len(task_label_rows(base.task)[0]) >= 3
    assert "label_rows" not in plain.metrics
    assert taught.metrics["train_rows"] == plain.metrics["train_rows"] == 60
    assert len(taught.metrics["per_label_f1"]) == 3
    assert taught.trained_on("billing") and not plain.trained_on("billing")
    assert not np.allclose(taught.weight.numpy(), plain.weight.numpy())
    clf = PrefixClassifier(task=base.task.replace(scoring="head", head=taught), loaded=loaded, verify=True, batch_size=4)
    assert_same_predictions(clf.classify(TEXTS[:6]), clf.classify_full(TEXTS[:6]))


def test_fit_label_rows_through_the_command_line(tiny_dir, tmp_path, capsys):
    head = tmp_path / "support.head"
    argv = ["--runner=DirectRunner", "--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
            f"--model={tiny_dir}", "--verify=false", "--folds=3", "--lexical=false"]
    assert fit.main(argv + [f"--output={head}", "--label_rows=true"]) == 0
    assert "rows: 60 used, 0 failed" in capsys.readouterr().out
    from beam_prefix import TaskSpec

    trained = TrainedHead.load(head)
    labels = TaskSpec.from_yaml(SUPPORT_TASK).labels
    assert trained.metrics["label_rows"] == len(labels) + sum(1 for label in labels if label.description)
    assert trained.metrics["train_rows"] == 60 and trained.trained_on(labels[0].name.replace("_", " "))
    summary = fit.run(argv + [f"--output={tmp_path}/plain.head", "--label_rows=false"])
    assert summary["label_rows"] == 0 and "label_rows" not in TrainedHead.load(tmp_path / "plain.head").metrics
    assert "label_rows_fold_accuracy" not in summary


def test_fit_with_label_rows_auto_keeps_the_variant_its_folds_prefer(tiny_dir, tmp_path):
    """The default (#64.1): with the features named, the head is fit with the task's label
    rows and without, on the same folds, and the better kept (a tie: without)."""
    argv = ["--runner=DirectRunner", "--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
            f"--model={tiny_dir}", "--verify=false", "--folds=3", "--lexical=false", "--layers=-1"]
    summary = fit.run(argv + [f"--output={tmp_path}/auto.head"])
    by_folds = summary["label_rows_fold_accuracy"]
    assert set(by_folds) == {"with", "without"} and all(0 <= v <= 1 for v in by_folds.values())
    kept = TrainedHead.load(tmp_path / "auto.head")
    taught = by_folds["with"] > by_folds["without"]
    assert ("label_rows" in kept.metrics) == taught and kept.metrics["kfold_accuracy"] == max(by_folds.values())
    for variant, flag in (("with", "true"), ("without", "false")):  # each variant is what that flag fits
        alone = fit.run(argv + [f"--output={tmp_path}/{variant}.head", f"--label_rows={flag}"])
        assert alone["kfold_accuracy"] == by_folds[variant]


def test_fit_refuses_label_rows_the_step_refused(tiny_dir, tmp_path, capsys):
    """A label row the step fails (here a description longer than --max_text_tokens with
    --overflow reject) is not an input row: not counted as a failed one, but an error."""
    text = open(SUPPORT_TASK, encoding="utf-8").read().replace(
        "description: charges, refunds, invoices, prices, payment methods, subscriptions",
        "description: " + "charges refunds invoices prices " * 40)
    (tmp_path / "task.yaml").write_text(text)
    assert fit.main(["--runner=DirectRunner", f"--task={tmp_path}/task.yaml", f"--input={SAMPLE}",
                     "--label_column=label", f"--model={tiny_dir}", "--verify=false", "--folds=3",
                     "--lexical=false", "--label_rows=true", "--max_text_tokens=100", "--overflow=reject",
                     f"--output={tmp_path}/h.head"]) == 2
    assert "1 of the task's 6 label rows failed" in capsys.readouterr().err
    assert not (tmp_path / "h.head").exists()


def test_fit_says_which_label_rows_variant_its_folds_kept(tiny_dir, tmp_path, capsys):
    assert fit.main(["--runner=DirectRunner", "--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
                     f"--model={tiny_dir}", "--verify=false", "--folds=3", "--lexical=false", "--layers=-1",
                     f"--output={tmp_path}/h.head"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("label rows (--label_rows auto)"))
    kept = "with" if "label_rows" in TrainedHead.load(tmp_path / "h.head").metrics else "without"
    assert line.endswith(f"kept {kept}")
