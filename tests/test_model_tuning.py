"""Tuning the model on labelled rows (`model_tuning`, `pipelines.tune`): only the layers a
head reads up to change; the tuned directory loads as any model and stays exact (cached ==
full re-encoding, the start-up self-check); its model id is its tuning record's, so heads
of the base model are refused on it; `pipelines.tune` writes model, head and task file
together or nothing, and refuses what it must not write over or cannot use."""

from __future__ import annotations

import os

import pytest
import torch

from beam_prefix import PrefixClassifier, TaskSpec, fit_head
from beam_prefix.engines.model_tuning import contrastive_loss, label_batches, tune_model
from beam_prefix.errors import TaskSpecError
from beam_prefix.model.loading import load_model, model_id
from beam_prefix.model.tuning_record import TUNING_FILE, read_record

from conftest import ROOT, TEXTS, tiny_task

LABELS = ("billing", "technical", "account")
SAMPLE = os.path.join(ROOT, "pipelines", "data", "sample_tickets.csv")


def _rows():
    texts = TEXTS * 2
    return texts, [LABELS[i % 3] for i in range(len(texts))]


@pytest.fixture(scope="module")
def tuned(tiny_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tuned") / "model")
    texts, labels = _rows()
    record = tune_model(tiny_task(), texts, labels, output_dir=out, model=tiny_dir, layers=(1,), pooling="mean",
                        epochs=4, learning_rate=1e-2, base_lexical_alpha=1.0)
    return out, record


def test_contrastive_loss_is_low_when_same_labels_align_and_high_when_they_do_not():
    y = torch.tensor([0, 0, 1, 1])
    aligned = torch.nn.functional.normalize(torch.tensor([[1., 0], [1, 0.01], [0, 1], [0.01, 1]]), dim=-1)
    crossed = aligned[[0, 2, 1, 3]]
    assert contrastive_loss(aligned, y, 0.1) < 0.01 < 1.0 < contrastive_loss(crossed, y, 0.1)


def test_label_batches_hold_each_label_once_per_batch_in_pairs_and_use_every_row_with_a_partner():
    import random

    rows = [(i, i % 5) for i in range(50)] + [(50, 9)]  # label 9 has one row: no positive pair
    batches = label_batches(rows, random.Random(0), per_label=4, labels_per_batch=3)
    seen = [r for b in batches for r, _ in b]
    assert sorted(seen) == list(range(50))
    for b in batches:
        per_label = {label: sum(1 for _, x in b if x == label) for _, label in b}
        assert len(per_label) <= 3 and min(per_label.values()) >= 2


def test_label_batches_are_full_when_the_rows_allow_it():
    """10 rows of each of 77 labels in chunks of 4, 4 and 2: a chunk whose label the open batch
    already holds waits for the next batch instead of closing this one (which left batches of
    6-16 labels when 16 were asked)."""
    import random

    rows = [(i, i % 77) for i in range(770)]
    for wanted in (16, 32):
        sizes = sorted(len({label for _, label in b}) for b in label_batches(rows, random.Random(0), labels_per_batch=wanted))
        assert sum(sizes) == 77 * 3 and max(sizes) == wanted
        assert sum(s < wanted for s in sizes) <= 2  # only where the chunks run out


def test_the_training_step_trains_the_features_a_head_reads(tiny_dir):
    """The training step: the engine's forward with gradients gives the cached
    engine's own mean-pooled features (each layer's part unit length), and the gradient
    reaches the layers up to the deepest one read, not past it."""
    import torch.nn.functional as F

    from beam_prefix.engines.model_tuning import train_features

    task = tiny_task()
    loaded = load_model(tiny_dir, prepack=False)
    clf = PrefixClassifier(task=task, loaded=loaded, batch_size=8, verify=False, prefix_attention="expanded")
    texts = ["I was charged twice", "the app crashes when I log in", "how do I change my address?"]
    for p in loaded.model.parameters():
        p.requires_grad_(True)
    z = train_features(loaded.model, clf.layout.prefix_ids, [clf.encode(t).suffix_ids for t in texts], (1, 2), "mean")
    reference = PrefixClassifier(task=task, loaded=load_model(tiny_dir), batch_size=8, verify=False)
    h = loaded.model.config.hidden_size
    read = torch.tensor([e.features for e in reference.embed(texts, (1, 2), pooling="mean")])
    expected = torch.cat([F.normalize(read[:, :h], dim=-1), F.normalize(read[:, h:], dim=-1)], -1) / 2 ** 0.5
    torch.testing.assert_close(z.detach(), expected, atol=1e-5, rtol=1e-4)
    z.pow(2).sum(-1).mul(torch.arange(3.0)).sum().backward()
    layers = loaded.model.base_model.layers
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layers[0].parameters())
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in layers[2].parameters())


def test_only_the_decoder_layers_up_to_the_deepest_read_change(tiny_dir, tuned):
    out, record = tuned
    base, after = load_model(tiny_dir).model, load_model(out).model
    changed = {name for name, p in after.state_dict().items() if not torch.equal(p, base.state_dict()[name])}
    assert changed and all(name.startswith("model.layers.0.") for name in changed)
    assert record.tuned_layers == 1 and len(record.losses) == 4 and record.losses[-1] < record.losses[0]
    assert record.base_lexical_alpha == 1.0 and read_record(out) == record


def test_the_tuned_directory_loads_exact_and_its_id_is_the_records_however_the_path_is_spelled(tuned, tmp_path):
    out, record = tuned
    link = tmp_path / "other-name"
    os.symlink(out, link)
    assert model_id(out) == model_id(str(link)) == record.id == load_model(str(link)).model_id
    assert record.id.endswith(record.id.rsplit("+tuned-", 1)[1]) and "+tuned-" in record.id
    clf = PrefixClassifier(task=tiny_task(), loaded=load_model(out), verify=True)  # self-check: cached == full
    assert {p.label for p in clf.classify(TEXTS)} <= set(LABELS)


def test_a_head_of_the_base_model_is_refused_on_the_tuned_one_and_the_reverse(tiny_dir, tuned):
    out, record = tuned
    texts, labels = _rows()
    heads = {}
    for spec in (tiny_dir, out):
        clf = PrefixClassifier(task=tiny_task(), loaded=load_model(spec), verify=False)
        heads[spec] = fit_head(clf, texts, labels, layers=(1,), pooling="mean", folds=2, lexical=False)
    for fit_on, other in ((tiny_dir, out), (out, tiny_dir)):
        task = tiny_task().replace(scoring="head", head=heads[fit_on])
        with pytest.raises(TaskSpecError, match="was fit on features"):
            PrefixClassifier.check_fits(task, other)
        PrefixClassifier.check_fits(task, fit_on)


def test_a_record_from_before_labels_per_batch_reads_as_16_and_keeps_its_model_id(tuned):
    """Tuned directories written before the setting existed ran with 16 labels a batch: their
    records read as that, and their ids (in every head fit on them) do not change."""
    import dataclasses
    import hashlib
    import json

    from beam_prefix.model.tuning_record import TuningRecord

    _, record = tuned
    assert record.labels_per_batch == 16
    old = json.loads(record.to_json())
    del old["labels_per_batch"]
    read = TuningRecord.from_json(json.dumps(old), "old")
    assert read == record and read.id == record.id
    before = {k: v for k, v in dataclasses.asdict(record).items() if k not in ("tune_s", "labels_per_batch")}
    digest = hashlib.sha256(json.dumps(before, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    assert record.id == f"{record.base_model}+tuned-{digest}"  # the formula those ids were made with
    assert dataclasses.replace(record, labels_per_batch=32).id != record.id


def test_fit_head_takes_a_given_ngram_weight_and_still_records_the_folds(tiny_dir):
    texts, labels = _rows()
    clf = PrefixClassifier(task=tiny_task(), loaded=load_model(tiny_dir), verify=False)
    head = fit_head(clf, texts, labels, folds=2, lexical_alpha=3.0)
    assert head.lexical is not None and head.lexical.alpha == 3.0 and head.metrics["lexical_alpha_given"]
    assert set(head.metrics["kfold_accuracy_by_lexical_alpha"]) >= {"0.0", "3.0"}
    with pytest.raises(ValueError, match="lexical_alpha must be >= 0"):
        fit_head(clf, texts, labels, folds=2, lexical_alpha=-1.0)


def test_tune_model_refuses_a_directory_with_files_and_labels_the_task_lacks(tiny_dir, tmp_path):
    texts, labels = _rows()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        tune_model(tiny_task(), texts, labels, output_dir=str(tmp_path / "full"), model=tiny_dir, layers=(1,))
    with pytest.raises(ValueError, match="lacks"):
        tune_model(tiny_task(), texts, ["refund"] * len(texts), output_dir=str(tmp_path / "new"), model=tiny_dir)
    assert not (tmp_path / "new").exists()


def test_pipelines_tune_writes_model_head_and_task_that_classify_together(tiny_dir, tmp_path, capsys, monkeypatch):
    from beam_prefix.engines import model_tuning
    from beam_prefix.pipelines import tune
    from beam_prefix.tasks.shipped import resolve_task

    # the task file is read once, at launch: an edit while the model tunes does not reach the
    # task file written beside the tuned model (which would then disagree with its head)
    task_file = tmp_path / "tickets.yaml"
    task_file.write_text(open(resolve_task("support_tickets"), encoding="utf-8").read(), encoding="utf-8")
    launched = TaskSpec.from_yaml(task_file)
    real = model_tuning.tune_model

    def edit_then_tune(*args, **kwargs):
        task_file.write_text(task_file.read_text(encoding="utf-8").replace(launched.instructions.strip()[:40],
                                                                           "Edited while tuning."), encoding="utf-8")
        return real(*args, **kwargs)

    monkeypatch.setattr(model_tuning, "tune_model", edit_then_tune)
    out = tmp_path / "tuned"
    assert tune.main([f"--task={task_file}", f"--input={SAMPLE}", "--label_column=label", f"--output={out}",
                      f"--model={tiny_dir}", "--layers", "-1", "--pooling=mean", "--epochs=1", "--folds=3", "--holdout=0",
                      "--labels_per_batch=2", f"--summary_output={tmp_path}/summary.json"]) == 0
    printed = capsys.readouterr().out
    assert "tuned model written" in printed and "overrates" in printed
    record = read_record(str(out))
    assert record.rows == 60 and record.tuned_layers == 3 and (out / TUNING_FILE).exists()
    assert record.labels_per_batch == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "tickets.yaml", "tuned"]  # no staging left
    assert "Edited while tuning." in task_file.read_text(encoding="utf-8")  # the edit happened
    task = TaskSpec.from_yaml(out / "support_tickets.yaml")
    assert task.scoring == "head" and task.head.layers == (-1,) and task.head.pooling == "mean"
    assert task.instructions == launched.instructions and task.labels == launched.labels
    clf = PrefixClassifier(task=task, loaded=load_model(str(out)), verify=True)
    assert clf.mode == "head" and {p.label for p in clf.classify(TEXTS)} <= set(LABELS)
    with pytest.raises(TaskSpecError, match="was fit on features"):
        PrefixClassifier.check_fits(task, tiny_dir)


def test_pipelines_tune_dtype_fits_the_heads_in_that_precision_and_the_head_answers_only_in_it(tiny_dir, tmp_path,
                                                                                                 capsys):
    from beam_prefix.pipelines import tune

    out = tmp_path / "tuned"
    assert tune.main(["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label", f"--output={out}",
                      f"--model={tiny_dir}", "--layers=1", "--pooling=mean", "--epochs=1", "--folds=2",
                      "--dtype=bfloat16", "--holdout=0"]) == 0
    assert "fit in bfloat16, which classify follows" in capsys.readouterr().out
    task = TaskSpec.from_yaml(out / "support_tickets.yaml")
    assert task.head.dtype == "bfloat16" and "in bfloat16" in (out / "support_tickets.yaml").read_text(encoding="utf-8")
    clf = PrefixClassifier(task=task, loaded=load_model(str(out), dtype="bfloat16"), verify=True)
    assert clf.mode == "head" and {p.label for p in clf.classify(TEXTS)} <= set(LABELS)
    PrefixClassifier.check_fits(task, str(out), dtype="bfloat16")
    PrefixClassifier.check_fits(task, str(out))  # no dtype: the head's
    with pytest.raises(ValueError, match="fit in bfloat16"):
        PrefixClassifier.check_fits(task, str(out), dtype="float32")  # float32 features: not the head's
    # the fingerprint still refuses float32 features where the head's dtype is not consulted
    with pytest.raises(TaskSpecError, match="was fit on features"):
        PrefixClassifier(task=task, loaded=load_model(str(out)), verify=False)


def test_pipelines_tune_self_checks_the_features_its_heads_read_not_lm_label_scores(tiny_dir, tmp_path, monkeypatch):
    """Nothing tune writes answers with LM label scores, whose full re-encoding per label took
    minutes on Banking77's 77 labels: the base and the tuned model are checked on the
    features at the heads' layers (cached == full re-encoding), and a head as it answers."""
    from beam_prefix.engines.classifier import PrefixClassifier as Engine
    from beam_prefix.pipelines import tune

    real_verify, real_features, checked = Engine.verify, Engine.verify_features, []

    def verify(self, *args, **kwargs):
        assert self.mode == "head", f"LM label scores self-checked ({self.mode})"
        return real_verify(self, *args, **kwargs)

    def verify_features(self, texts=(), layers=(-1,), **kwargs):
        checked.append((tuple(layers), kwargs.get("pooling")))
        return real_features(self, texts, layers, **kwargs)

    monkeypatch.setattr(Engine, "verify", verify)
    monkeypatch.setattr(Engine, "verify_features", verify_features)
    assert tune.main(["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
                      f"--output={tmp_path}/tuned", f"--model={tiny_dir}", "--layers=1", "--pooling=mean",
                      "--epochs=1", "--folds=2"]) == 0
    assert checked == [((1,), "mean"), ((1,), "mean")]  # the base model, then the tuned one


def test_pipelines_tune_in_half_precision_writes_nothing_when_the_written_heads_self_check_fails(
        tiny_dir, tmp_path, capsys, monkeypatch):
    """The written head is checked as classify will run it (its dtype, cached == full): a
    head failing that check is not written, nor is the tuned model."""
    from beam_prefix.engines.classifier import PrefixClassifier as Engine
    from beam_prefix.errors import VerificationError
    from beam_prefix.pipelines import tune

    real = Engine.verify

    def head_disagrees(self, *args, **kwargs):
        if self.mode == "head":
            raise VerificationError("cached head probabilities differ (injected)", [])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "verify", head_disagrees)
    assert tune.main(["--task=support_tickets", f"--input={SAMPLE}", "--label_column=label",
                      f"--output={tmp_path}/tuned", f"--model={tiny_dir}", "--layers=1", "--pooling=mean",
                      "--epochs=1", "--folds=2", "--dtype=bfloat16", "--holdout=0"]) == 1
    assert "injected" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # no tuned directory, no staging left


def test_pipelines_tune_refuses_before_any_model_work(tiny_dir, tmp_path, capsys):
    from beam_prefix.pipelines import tune

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "model.safetensors").write_text("")
    common = ["--task=support_tickets", "--label_column=label", f"--model={tiny_dir}", "--epochs=1"]
    assert tune.main([*common, f"--input={SAMPLE}", f"--output={taken}"]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert tune.main([*common, f"--input={SAMPLE}", f"--output={tiny_dir}"]) == 2  # the model it reads
    assert tune.main([*common, f"--input={SAMPLE}", f"--output={tmp_path}/out", "--learning_rate=0"]) == 2
    assert "learning_rate > 0" in capsys.readouterr().err
    assert tune.main([*common, f"--input={SAMPLE}", f"--output={tmp_path}/out", "--labels_per_batch=1"]) == 2
    assert "labels_per_batch must be >= 2" in capsys.readouterr().err
    assert tune.main([*common, f"--input={SAMPLE}", f"--output={tmp_path}/out", f"--summary_output={SAMPLE}"]) == 2
    assert "which this run reads" in capsys.readouterr().err
    assert tune.main([*common, f"--input={SAMPLE}", f"--output={tmp_path}/out", "--dtype=float16"]) == 2
    assert "float16 is for GPUs" in capsys.readouterr().err  # pipelines.tune runs on the CPU
    gaps = tmp_path / "gaps.csv"
    gaps.write_text("text,label\nmy invoice is wrong,billing\n,technical\nlocked out,\n")
    assert tune.main([*common, f"--input={gaps}", f"--output={tmp_path}/out"]) == 2
    assert "2 of 3 input rows cannot train (1 empty_text, 1 no_label" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
