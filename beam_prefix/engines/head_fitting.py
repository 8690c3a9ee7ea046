"""Fitting a trained head (`TrainedHead`) on labelled rows, inside one Python program.

    from beam_prefix import PrefixClassifier, TaskSpec, fit_head
    clf = PrefixClassifier.load(TaskSpec.from_yaml("support_tickets"))
    head = fit_head(clf, texts, labels, layers=(-1,))          # features by the cached engine
    head.save("support.head")
    task = clf.task.replace(scoring="head", head=head, calibration=False)

`fit_head` computes the rows' features with the classifier's own cached forward (what the
head will read when it answers), then `fit_head_from_features` fits a multinomial logistic
regression on standardised features, the regularisation chosen by stratified k-fold
cross-validation (scikit-learn's `LogisticRegressionCV`), and records the fold accuracy,
per-label F1 and a hash of every training text. With `lexical` (the default) it also fits
a regression on the rows' word and character n-grams (`lexical_head`) and weighs the two
by the same folds: the weight (0 drops the n-grams) whose combined out-of-fold answers are
most often right. With `label_rows`, the task's own words join the training rows
(`task_label_rows`: each label's name read as text, and its description): they train
every fold's regressions and the final one, and are never held out, so the fold accuracy
stays a measure on the labelled rows alone. `python -m beam_prefix.pipelines.fit` does the same with
the features computed by a Beam pipeline on any runner.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import numpy as np
import torch

from beam_prefix.model.early_exit import check_layers
from beam_prefix.model.half_precision import dtype_of, precision_name
from beam_prefix.tasks.lexical_head import ALPHAS, fit_lexical, out_of_fold, softmax_weights
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.tasks.trained_head import TrainedHead, feature_fingerprint, text_hash

__all__ = ["fit_head", "fit_head_from_features", "check_labels", "task_label_rows", "C_GRID"]

C_GRID = (0.01, 0.1, 1.0, 10.0)  # the regularisation grid (inverse strength) k-fold chooses from


def fit_head(classifier, texts: Sequence[str], labels: Sequence[str], *, layers: Sequence[int] = (-1,),
             pooling: str = "last", folds: int = 5, lexical: bool = True, label_rows: bool = False,
             lexical_alpha: float | None = None) -> TrainedHead:
    """A head for `classifier`'s task, prompt, model and dtype, fit on `texts` and their
    `labels` (names of the task's labels; every label needs a row). `lexical_alpha`: the
    n-grams' weight, given instead of chosen by the folds (for a model tuned on these rows,
    whose folds would overrate its states: `model_tuning`).

    Raises:
        ValueError: labels the task lacks, or task labels with no row.
    """
    texts, labels = list(texts), [str(v) for v in labels]
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
    task = classifier.task
    if task.head is not None or task.calibration:  # features are read as a plain prompt's
        task = task.replace(scoring="auto", head=None, calibration=False)
    check_labels(task, labels)
    check_layers(classifier.model.config, layers)  # before any features are computed

    def embedded(rows):
        encoded = [classifier.encode(t) for t in rows]  # once: the features and the n-grams read the same text
        return (np.asarray([e.features for e in classifier.embed_encoded(encoded, layers=tuple(layers), pooling=pooling)],
                           dtype=np.float32).reshape(len(rows), -1), [e.text for e in encoded])

    features, read = embedded(texts)
    extra = None
    if label_rows:
        extra_texts, extra_labels = task_label_rows(task)
        extra_features, extra_read = embedded(extra_texts)
        extra = (extra_features, extra_labels, extra_read, [text_hash(t) for t in extra_texts])
    precision = precision_name(classifier.model)
    fingerprint = feature_fingerprint(classifier.features_fingerprint, precision, tuple(layers), pooling)
    return fit_head_from_features(features, labels, [text_hash(t) for t in texts], task, layers=tuple(layers),
                                  fingerprint=fingerprint, folds=folds, pooling=pooling,
                                  texts=read if lexical else None, extra=extra, lexical_alpha=lexical_alpha,
                                  dtype=dtype_of(precision))


def task_label_rows(task: TaskSpec) -> tuple[list[str], list[str]]:
    """The task's own words as labelled rows (texts, labels): each label's name as text
    (underscores read as spaces: ``card_arrival`` -> "card arrival"), and its description
    when it has one."""
    texts, labels = [], []
    for label in task.labels:
        texts.append(label.name.replace("_", " ").strip() or label.name)
        labels.append(label.name)
        if label.description:
            texts.append(label.description)
            labels.append(label.name)
    return texts, labels


def check_labels(task: TaskSpec, labels) -> collections.Counter:
    """The rows per label, after refusing labels the task lacks and task labels with no row
    (so fewer than two classes too: a task has two labels or more); each error says which."""
    counts = collections.Counter("" if v is None else str(v) for v in labels)
    unknown = sorted(set(counts) - set(task.label_names))
    if unknown:
        raise ValueError(f"--label_column holds labels the task {task.name!r} lacks: {unknown[:10]}"
                         + (f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else "")
                         + f"; its labels are {list(task.label_names)[:10]}...")
    missing = [n for n in task.label_names if n not in counts]
    if missing:
        raise ValueError(f"task {task.name!r} labels with no training row: {missing[:10]}"
                         + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else "")
                         + "; a head can only answer labels it saw (add rows, or drop the labels from the task)")
    return counts  # every task label has a row, and a task has two or more: two classes at least


def fit_head_from_features(features: np.ndarray, labels: list[str], hashes: list[int], task: TaskSpec, *, layers,
                           fingerprint: str, folds: int, pooling: str = "last",
                           texts: Sequence[str] | None = None, extra=None,
                           lexical_alpha: float | None = None, dtype: str | None = None) -> TrainedHead:
    """A multinomial logistic regression on standardised features; the regularisation by
    stratified k-fold cross-validation (accuracy), with the fold accuracy and per-label F1
    of the chosen one in the head's metrics. With `texts` (each row's text as the engine
    reads it), the lexical part too, weighed by the same folds (module docstring). `extra`:
    rows that only ever train, ``(features [E, F], labels, texts, hashes)`` (the task's
    label rows). `lexical_alpha`: the n-grams' weight, given instead of chosen (the folds'
    accuracy at each weight is still recorded). `dtype`: the `load_model` dtype the features
    came from, which the head records (a step given none runs in it)."""
    from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
    from sklearn.metrics import f1_score
    from sklearn.model_selection import StratifiedKFold

    if lexical_alpha is not None and not lexical_alpha >= 0:
        raise ValueError(f"lexical_alpha must be >= 0 (0 drops the n-grams), got {lexical_alpha}")

    mean = features.mean(0)
    std = features.std(0)
    std[std < 1e-6] = 1.0
    names = list(task.label_names)
    y = np.array([names.index(label) for label in labels])
    smallest = int(np.bincount(y, minlength=len(names)).min())
    k = min(folds, smallest)
    metrics: dict = {"train_rows": len(y), "rows_per_label_min": smallest}
    n = len(y)
    if extra is not None:  # after the labelled rows: never held out
        extra_features, extra_labels, extra_texts, extra_hashes = extra
        features = np.concatenate([features, extra_features])
        y = np.concatenate([y, [names.index(label) for label in extra_labels]])
        texts = None if texts is None else list(texts) + list(extra_texts)
        hashes = list(hashes) + list(extra_hashes)
        metrics["label_rows"] = len(extra_labels)
    x = (features - mean) / std  # standardised by the labelled rows' statistics
    start = time.perf_counter()
    lexical = None
    if k >= 2:
        always_train = np.arange(n, len(y))  # the extra rows: in every split's training rows
        splits = [(np.concatenate([train, always_train]), test) for train, test in
                  StratifiedKFold(n_splits=k, shuffle=True, random_state=0).split(x[:n], y[:n])]
        search = LogisticRegressionCV(Cs=list(C_GRID), cv=splits, scoring="accuracy", max_iter=2000, l1_ratios=(0.0,),
                                      use_legacy_attributes=False).fit(x, y)
        c = float(np.atleast_1d(search.C_)[0])
        oof = out_of_fold(LogisticRegression(C=c, max_iter=2000), x, y, splits, len(names))
        predicted = oof.argmax(1)
        if texts is not None:
            lexical, lexical_oof = fit_lexical(texts, y, len(names), cv=splits)
            by_alpha = {a: float(((oof + a * lexical_oof).argmax(1) == y[:n]).mean()) for a in ALPHAS}
            alpha = max(ALPHAS, key=lambda a: (by_alpha[a], -a))  # a tie: the fewer n-grams
            if lexical_alpha is not None:
                alpha = float(lexical_alpha)
                metrics["lexical_alpha_given"] = True
            metrics.update(kfold_accuracy_hidden_states=round(by_alpha[0.0], 4),
                           kfold_accuracy_by_lexical_alpha={str(a): round(v, 4) for a, v in by_alpha.items()},
                           lexical_alpha=alpha)
            if alpha > 0:
                lexical.alpha = alpha
                predicted = (oof + alpha * lexical_oof).argmax(1)
            else:
                lexical = None
        f1 = f1_score(y[:n], predicted, average=None, labels=list(range(len(names))), zero_division=0)
        metrics.update(folds=k, C=c, kfold_accuracy=round(float((predicted == y[:n]).mean()), 4),
                       per_label_f1={name: round(float(v), 4) for name, v in zip(names, f1)})
        model = LogisticRegression(C=c, max_iter=2000).fit(x, y)
    else:  # a label with one row: nothing to cross-validate (nor to weigh n-grams by)
        model = LogisticRegression(C=1.0, max_iter=2000).fit(x, y)
        metrics.update(folds=0, C=1.0, kfold_accuracy=None, note="a label has a single row: no cross-validation")
    metrics["fit_s"] = round(time.perf_counter() - start, 2)
    weight, bias = softmax_weights(model, len(names))  # (two labels: sklearn gives one row)
    return TrainedHead(labels=names, layers=layers, weight=torch.from_numpy(weight), bias=torch.from_numpy(bias),
                       mean=torch.from_numpy(mean.astype(np.float32)), std=torch.from_numpy(std.astype(np.float32)),
                       fingerprint=fingerprint, train_hashes=hashes, metrics=metrics, pooling=pooling,
                       lexical=lexical, dtype=dtype)
