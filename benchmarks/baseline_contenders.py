"""The contenders of `benchmarks.baselines`: what a user with labelled rows would use instead
(TF-IDF + logistic regression, all-MiniLM-L6-v2 + logistic regression) and this project's
trained heads in each way they ship (depth, precision, tuned or not), each with ``fit(rows)``
returning a fitted contender and ``predict(texts)`` its labels; and which contenders a run
may ask for (`chosen_contenders`). What each is, and why: `benchmarks.baselines`' docstring.
"""

from __future__ import annotations

import json
import os

import numpy as np

from benchmarks.data import TASKS


class Tfidf:
    name = "TF-IDF word 1-2 + char 2-5 + logistic regression"

    def fit(self, rows):
        from scipy.sparse import hstack
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression

        texts = [t for t, _ in rows]
        self.w = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit(texts)
        self.c = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True, min_df=2).fit(texts)
        self._x = lambda ts: hstack([self.w.transform(ts), self.c.transform(ts)]).tocsr()
        self.model = LogisticRegression(C=10.0, max_iter=3000).fit(self._x(texts), [g for _, g in rows])
        return self

    def predict(self, texts):
        return list(self.model.predict(self._x(texts)))


def _cv_logistic(x, y):
    """Logistic regression on standardised features, C by stratified 5-fold CV (as our heads)."""
    from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    k = min(5, min(np.unique(y, return_counts=True)[1]))
    search = make_pipeline(StandardScaler(), LogisticRegressionCV(
        Cs=[0.01, 0.1, 1.0, 10.0], cv=StratifiedKFold(k, shuffle=True, random_state=0), max_iter=2000,
        l1_ratios=(0.0,), use_legacy_attributes=False)).fit(x, y)
    c = float(np.atleast_1d(search[-1].C_)[0])
    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000)).fit(x, y)


class MiniLM:
    name = "all-MiniLM-L6-v2 embeddings + logistic regression"

    def __init__(self):
        import all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        from beam_prefix.model.loading import cache_root

        path = os.path.join(cache_root(), "all-MiniLM-L6-v2")  # unpacked once, read offline
        if not os.path.exists(os.path.join(path, "all-MiniLM-L6-v2")):
            all_minilm_l6_v2.extract_model(path)
        self.encoder = SentenceTransformer(os.path.join(path, "all-MiniLM-L6-v2"), device="cpu")

    def embed(self, texts):
        return self.encoder.encode(list(texts), batch_size=64, convert_to_numpy=True)

    def fit(self, rows, label_rows=False):
        rows = list(rows) + (_label_rows() if label_rows else [])
        self.model = _cv_logistic(self.embed([t for t, _ in rows]), [g for _, g in rows])
        return self

    def predict(self, texts):
        return list(self.model.predict(self.embed(texts)))


class Ours:
    name = "ours: embedded SmolLM2-135M, prefix-cached, trained head"
    task_file = "banking77_head.yaml"
    shipped = True  # the task's head file fits this precision (else only heads fit here answer)
    layers: tuple[int, ...] | None = None  # the head's layers, when not the task's head's
    dtype = "float32"  # the model it is given: load_model's dtype

    def __init__(self, loaded, head=None):
        from beam_prefix import PrefixClassifier, TaskSpec

        self.task = TaskSpec.from_yaml(os.path.join(TASKS, self.task_file))
        self.loaded = loaded
        self.head = head if head is not None or not self.shipped else self.task.head
        self.clf = None if self.head is None else PrefixClassifier(task=self.task.replace(head=self.head),
                                                                   loaded=loaded, batch_size=64, verify=False)

    def fit(self, rows, label_rows=False):
        from beam_prefix import PrefixClassifier, fit_head

        shipped = self.task.head
        base = PrefixClassifier(task=self.task.replace(scoring="auto", head=None), loaded=self.loaded,
                                batch_size=64, verify=False)
        head = fit_head(base, [t for t, _ in rows], [g for _, g in rows], layers=self.layers or shipped.layers,
                        pooling=shipped.pooling, label_rows=label_rows)
        return type(self)(self.loaded, head)

    def predict(self, texts):
        return [p.label for p in self.clf.classify(list(texts))]


class OursEarly(Ours):
    """The same prompt, a head on layers 6 and 12: the forward stops after layer 12 of 30."""

    name = "ours, early exit: the same, head on layers 6 and 12 (12 of 30 layers run)"
    task_file = "banking77_fast_head.yaml"


class OursEarlyHalf(OursEarly):
    """The early-exit head in bfloat16 (the base model's linear layers in bf16, the rest
    float32: `half_precision`), its heads fit here in that precision, with the shipped fast
    head's layers and pooling, on the same rows (a head answers only in the precision it
    was fit in)."""

    name = "ours, early exit, bfloat16: the same in bf16 linears, its head fit in bf16"
    shipped = False
    dtype = "bfloat16"


class OursEarlyTuned(OursEarly):
    """The early-exit head on the model tuned on the same rows (`pipelines.tune`'s steps:
    the base model's head on the same rows gives the n-gram weight, layers 1-12 tuned
    contrastively on the head's features, the head fit on the tuned model with that weight).
    It runs the early-exit head's layers."""

    name = "ours, early exit, tuned: the same, the model's layers 1-12 tuned on the rows (pipelines.tune)"
    shipped = False
    dtype = "float32"
    # 4 epochs of 770 rows are 48 steps of 64 rows (benchmarks.tuning_survey); one epoch
    # of the whole split is 156 steps, about 20-35 min on 2 cores
    few_epochs, full_epochs = 4, 1

    def fit(self, rows, label_rows=False, *, base=None, tuned=None):
        """`base`: the base model's head fit on the same rows in this contender's precision
        (its n-gram weight; `pipelines.tune`'s step 1, fit once by the early-exit contender);
        `tuned`: a contender whose model was tuned on the same rows (reused, not tuned again)."""
        import tempfile

        from beam_prefix import PrefixClassifier, fit_head
        from beam_prefix.engines.model_tuning import tune_model
        from beam_prefix.model import load_model

        texts, labels = [t for t, _ in rows], [g for _, g in rows]
        spec = self.task.head
        layers = self.layers or spec.layers
        alpha = base.lexical.alpha if base.lexical is not None else 0.0
        task = self.task.replace(scoring="auto", head=None)
        if tuned is None:
            self._dir = tempfile.TemporaryDirectory()  # lives as long as the contenders holding it
            out = os.path.join(self._dir.name, "tuned")
            self.record = tune_model(task, texts, labels, output_dir=out, layers=layers, pooling=spec.pooling,
                                     epochs=self.full_epochs if len(rows) > 2000 else self.few_epochs,
                                     base_lexical_alpha=alpha, log=print)
        else:
            self._dir, self.record = tuned._dir, tuned.record
            out = os.path.join(self._dir.name, "tuned")
        # cached == full checked in float32 (the float32 contender checks the directory the bf16
        # one reuses; a bf16 one tuning on its own checks it here): in bf16 the tuned model's LM
        # label scores, which no head reads, can differ from re-encoding beyond bf16's tolerance
        # (they did at 10 per intent, 2026-12-05)
        if tuned is None and self.dtype != "float32":
            PrefixClassifier(task=task, loaded=load_model(out), batch_size=64, verify=True)
        loaded = load_model(out, dtype=self.dtype)
        on_tuned = PrefixClassifier(task=task, loaded=loaded, batch_size=64, verify=self.dtype == "float32")
        head = fit_head(on_tuned, texts, labels, layers=layers, pooling=spec.pooling, label_rows=label_rows,
                        lexical_alpha=alpha)
        model = type(self)(loaded, head)
        model._dir, model.record = self._dir, self.record
        return model


class OursEarlyTunedHalf(OursEarlyTuned):
    """The tuned model (the same tuning, reused) loaded in bfloat16, its head fit in bf16
    with the bf16 base head's n-gram weight: `pipelines.tune --dtype bfloat16`. It runs the
    bf16 early-exit head's layers."""

    name = "ours, early exit, tuned, bfloat16: the tuned model in bf16 linears, its head fit in bf16"
    dtype = "bfloat16"


class OursExit6Half(OursEarlyHalf):
    """A head on layer 6 alone, in bfloat16: the forward stops after 6 of the model's 30 layers."""

    name = "ours, exit at layer 6, bfloat16: the same prompt, head on layer 6 (6 of 30 layers run), fit in bf16"
    layers = (6,)


class OursExit2Half(OursExit6Half):
    """A head on layer 2 alone, in bfloat16: the forward stops after 2 of 30 layers (training
    folds, `benchmarks.layer_survey --layers 0,1,2`: 91.1% against layer 6's 91.5%)."""

    name = "ours, exit at layer 2, bfloat16: the same prompt, head on layer 2 (2 of 30 layers run), fit in bf16"
    layers = (2,)


class OursExit1Half(OursExit6Half):
    """A head on layer 1 alone, in bfloat16: one decoder layer runs (training folds: 91.1%)."""

    name = "ours, exit at layer 1, bfloat16: the same prompt, head on layer 1 (1 of 30 layers run), fit in bf16"
    layers = (1,)


class OursExit6TunedHalf(OursEarlyTunedHalf):
    """The layer-6 head on the model whose layers 1-6 were tuned on the rows (in float32, as
    `pipelines.tune --dtype bfloat16` tunes), loaded in bf16; the n-gram weight from the bf16
    layer-6 head of the same rows."""

    name = "ours, exit at layer 6, tuned, bfloat16: the same, the model's layers 1-6 tuned on the rows"
    layers = (6,)


class OursExit1TunedHalf(OursEarlyTunedHalf):
    """The layer-1 head on the model whose layer 1 was tuned on the rows (in float32), loaded
    in bf16; the n-gram weight from the bf16 layer-1 head of the same rows."""

    name = "ours, exit at layer 1, tuned, bfloat16: the same, the model's layer 1 tuned on the rows"
    layers = (1,)



def _cli(module: str, *flags: str) -> None:
    """Run a pipeline's CLI as a user does (a fresh process, the checkout's own modules)."""
    import subprocess
    import sys

    from benchmarks.data import ROOT

    subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, check=True)


def _rows_csv(rows, path: str) -> str:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["text", "category"])
        out.writerows(rows)
    return path


class OursDefault(Ours):
    """What a user gets from plain `pipelines.fit` (no feature flags): its features chosen
    by folds of the training rows among its candidates (#55), fit by the CLI itself; the
    head file it writes, and its summary, are kept under the run's ``heads/`` folder."""

    name = "ours, default fit: plain `pipelines.fit`, features chosen by folds"
    shipped = False
    flags: tuple[str, ...] = ()
    keep: str | None = None  # where heads are kept (baselines sets it)

    def fit(self, rows, label_rows=False):
        import tempfile

        from beam_prefix.tasks.trained_head import TrainedHead

        regime = "full" if len(rows) > 2000 else "few"
        out = os.path.join(self.keep or tempfile.mkdtemp(), f"{type(self).__name__}_{regime}")
        os.makedirs(out, exist_ok=True)
        _cli("pipelines.fit", "--runner=DirectRunner", "--task=banking77_head",
             f"--input={_rows_csv(rows, os.path.join(out, 'rows.csv'))}", "--label_column=category",
             f"--output={out}/banking77.head", f"--summary_output={out}/summary.json", "--batch_size=64",
             *self.flags)
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
        model = type(self)(self.loaded, TrainedHead.load(os.path.join(out, "banking77.head")))
        model.summary, model.dir = summary, out
        return model


class OursDefaultHalf(OursDefault):
    """Plain `pipelines.fit --dtype bfloat16`: the same search, in bf16 linears (the head
    records it; classify then runs in it by default)."""

    name = "ours, default fit, bfloat16: `pipelines.fit --dtype bfloat16`, features chosen by folds"
    dtype = "bfloat16"
    flags = ("--dtype=bfloat16",)


class OursDefaultTuned(OursDefault):
    """Plain `pipelines.tune` on the default-fit head's rows, task and features (its layers
    and pooling), as a user runs it after a plain fit: 20% of each label's rows held out, the
    tuned model kept only when its head beats the untuned one there (#55.2), else the
    untuned head (then this contender is that head)."""

    name = "ours, default fit + `pipelines.tune` (kept only if it wins on held-out rows)"

    def fit(self, rows, label_rows=False, *, base=None, tuned=None):
        import yaml

        from beam_prefix import TaskSpec
        from beam_prefix.model import load_model

        out = base.dir + "_tuned"
        task_file = os.path.join(base.dir, "banking77_head.yaml")
        with open(os.path.join(TASKS, "banking77_head.yaml"), encoding="utf-8") as f:
            data = yaml.safe_load(f)
        with open(task_file, "w", encoding="utf-8") as f:
            yaml.safe_dump({**data, "head": "banking77.head"}, f, sort_keys=False)
        _cli("pipelines.tune", f"--task={task_file}", f"--input={os.path.join(base.dir, 'rows.csv')}",
             "--label_column=category", f"--output={out}", f"--summary_output={out}.summary.json",
             *(("--dtype=" + base.head.dtype,) if base.head.dtype else ()))
        with open(f"{out}.summary.json", encoding="utf-8") as f:
            summary = json.load(f)
        task = TaskSpec.from_yaml(os.path.join(out, "banking77_head.yaml"))
        loaded = load_model(out if summary["kept"] else "embedded", dtype=task.head.dtype or "float32")
        model = type(self)(loaded, task.head)
        model.summary, model.dir = summary, out
        return model


# report keys of the contenders, in the table's order
CONTENDERS = {"tfidf": Tfidf, "minilm": MiniLM, "ours": Ours, "ours_early": OursEarly,
              "ours_early_bf16": OursEarlyHalf, "ours_early_tuned": OursEarlyTuned,
              "ours_early_tuned_bf16": OursEarlyTunedHalf, "ours_exit6_bf16": OursExit6Half,
              "ours_exit6_tuned_bf16": OursExit6TunedHalf, "ours_exit2_bf16": OursExit2Half,
              "ours_exit1_bf16": OursExit1Half, "ours_exit1_tuned_bf16": OursExit1TunedHalf,
              "ours_default": OursDefault, "ours_default_tuned": OursDefaultTuned,
              "ours_default_bf16": OursDefaultHalf}
# a tuned contender's base: the untuned one of the same rows and precision, whose head gives
# it the n-gram weight
BASES = {"ours_early_tuned": "ours_early", "ours_early_tuned_bf16": "ours_early_bf16",
         "ours_exit6_tuned_bf16": "ours_exit6_bf16", "ours_exit1_tuned_bf16": "ours_exit1_bf16",
         "ours_default_tuned": "ours_default"}
# a contender that reuses another's tuning (pipelines.tune --dtype bfloat16 tunes in float32)
REUSES = {"ours_early_tuned_bf16": "ours_early_tuned"}


def chosen_contenders(value: str) -> list[str]:
    """The report keys `--contenders` names, in the table's order; refused when one is unknown
    or a tuned one comes without its base."""
    keys = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONTENDERS]
    if unknown or not keys:
        raise SystemExit(f"--contenders: unknown {unknown or 'empty list'}; choose from {', '.join(CONTENDERS)}")
    missing = [f"{k} needs {BASES[k]}" for k in keys if k in BASES and BASES[k] not in keys]
    if missing:
        raise SystemExit(f"--contenders: {'; '.join(missing)} (its head gives the n-gram weight)")
    return [k for k in CONTENDERS if k in keys]


def _label_rows() -> list[tuple[str, str]]:
    """The banking77_head task's label rows (`head_fitting.task_label_rows`) as (text, label)."""
    from beam_prefix import TaskSpec
    from beam_prefix.engines.head_fitting import task_label_rows

    texts, labels = task_label_rows(TaskSpec.from_yaml(os.path.join(TASKS, "banking77_head.yaml")))
    return list(zip(texts, labels))
