"""Trained heads against LM label scoring: held-out accuracy, per-row cost, fitting time.

    python -m benchmarks.heads                       # everything (about half an hour on 2 cores)
    python -m benchmarks.heads --skip fit_time       # accuracy and cost only

Accuracy is measured only on rows that fit nothing: the 66 held-out support tickets
(`pipelines/data/heldout_tickets.csv`) and the Banking77 test split (3,080 rows); the heads
are fit on the 60 sample tickets and on the Banking77 train split (all 10,003 rows, and 10
rows per intent drawn with seed 77). LM scoring of Banking77 is measured on the first
`--banking77_lm_rows` rows of the random test sample (it costs seconds a row). Cost: ms per row of
`PrefixClassifier.classify` at batch 64 for each contender, best of `--rounds`
interleaved rounds in this one process. Fitting time: `pipelines.fit` on the 10,003
training rows (features + regression) against classifying the same rows with the fitted
head, both through DirectRunner in this run.

Writes `heads.json` and `heads.md` under `--out_dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

from beam_prefix import PrefixClassifier, TaskSpec
from beam_prefix.beam.embed_transform import features_task
from beam_prefix.model.loading import load_model
from beam_prefix.tasks.trained_head import feature_fingerprint, text_hash
from benchmarks.data import DATA, TASKS, RESULTS, csv_rows


def _accuracy(clf: PrefixClassifier, rows) -> float:
    preds = clf.classify([t for t, _ in rows])
    return round(sum(p.label == g for p, (_, g) in zip(preds, rows)) / len(rows), 4)


def _fit(base: PrefixClassifier, rows, layers=(-1,)):
    """A head over `base`'s features, fit the way `pipelines.fit` fits one."""
    import numpy as np

    from beam_prefix.pipelines.fit import fit_head

    features = np.asarray([e.features for e in base.embed([t for t, _ in rows], layers=layers)], dtype=np.float32)
    fingerprint = feature_fingerprint(base.features_fingerprint, torch.float32, layers)
    return fit_head(features, [g for _, g in rows], [text_hash(t) for t, _ in rows], base.task, layers=layers,
                    fingerprint=fingerprint, folds=5)


def _timed(fn, rows) -> float:
    start = time.perf_counter()
    fn([t for t, _ in rows])
    return 1e3 * (time.perf_counter() - start) / len(rows)


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cost_rows", type=int, default=256, help="rows per contender in the cost section")
    parser.add_argument("--banking77_lm_rows", type=int, default=100)
    parser.add_argument("--skip", default="", type=lambda s: set(x for x in s.split(",") if x),
                        help="sections to skip: accuracy, cost, fit_time")
    parser.add_argument("--out_dir", default=RESULTS)
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    report = {"model": loaded.model_id, "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
              "torch_threads": torch.get_num_threads()}
    support_train, support_test = csv_rows(os.path.join(DATA, "sample_tickets.csv")), \
        csv_rows(os.path.join(DATA, "heldout_tickets.csv"))
    bank_train = csv_rows(os.path.join(DATA, "banking77", "train.csv"), label="category")
    bank_test = csv_rows(os.path.join(DATA, "banking77", "test.csv"), label="category")
    support = TaskSpec.from_yaml(os.path.join(TASKS, "support_tickets.yaml"))
    support_head = TaskSpec.from_yaml(os.path.join(TASKS, "support_tickets_head.yaml"))
    bank_lm = TaskSpec.from_yaml(os.path.join(TASKS, "banking77.yaml"))
    bank_head = TaskSpec.from_yaml(os.path.join(TASKS, "banking77_head.yaml"))
    engines = {name: PrefixClassifier(task=task, loaded=loaded, batch_size=64, verify=False)
               for name, task in (("support LM (calibrated)", support), ("support head", support_head),
                                  ("banking77 head", bank_head))}
    if "accuracy" not in args.skip:
        acc = {"support LM (calibrated), 66 held-out": _accuracy(engines["support LM (calibrated)"], support_test),
               "support head (fit on 60 sample tickets), 66 held-out": _accuracy(engines["support head"],
                                                                                 support_test),
               "banking77 head (fit on 10,003 train rows), 3,080 test": _accuracy(engines["banking77 head"],
                                                                                  bank_test)}
        bank_base = PrefixClassifier(task=features_task(bank_head), loaded=loaded, batch_size=64, verify=False)
        by_label: dict[str, list] = {}
        for row in bank_train:
            by_label.setdefault(row[1], []).append(row)
        few = [r for label in sorted(by_label) for r in random.Random(77).sample(by_label[label], 10)]
        head10 = _fit(bank_base, few)
        few_clf = PrefixClassifier(task=bank_head.replace(head=head10), loaded=loaded, batch_size=64, verify=False)
        acc["banking77 head (fit on 10 rows per intent, 770 rows), 3,080 test"] = _accuracy(few_clf, bank_test)
        lm = PrefixClassifier(task=bank_lm, loaded=loaded, batch_size=16, verify=False)
        sample = csv_rows(os.path.join(DATA, "banking77", "test_sample.csv"), label="category")  # random test rows
        acc[f"banking77 LM scoring (shipped task, pruned), {args.banking77_lm_rows} random test rows"] = _accuracy(
            lm, sample[:args.banking77_lm_rows])
        report["accuracy"] = acc
        report["head_metrics"] = {name: {k: v for k, v in clf.task.head.metrics.items() if k != "per_label_f1"}
                                  for name, clf in engines.items() if clf.task.head is not None}
        print(json.dumps(report["accuracy"], indent=1), flush=True)
    if "cost" not in args.skip:
        rows = {"support": (support_train + support_test) * 4, "banking77": bank_test}
        contenders = [("support LM (calibrated)", "support"), ("support head", "support"),
                      ("banking77 head", "banking77")]
        times: dict[str, list[float]] = {name: [] for name, _ in contenders}
        for name, data in contenders:  # warm-up
            engines[name].classify([t for t, _ in rows[data][:64]])
        for _ in range(args.rounds):
            for name, data in contenders:
                times[name].append(round(_timed(engines[name].classify, rows[data][:args.cost_rows]), 2))
        best = {name: min(v) for name, v in times.items()}
        report["cost"] = {"ms_per_row_rounds": times, "ms_per_row_best": best,
                          "prefix_tokens": {name: clf.prefix_length for name, clf in engines.items()},
                          "banking77 head / support LM": round(best["banking77 head"]
                                                               / best["support LM (calibrated)"], 3),
                          "banking77 head / support head": round(best["banking77 head"] / best["support head"], 3)}
        print(json.dumps(report["cost"], indent=1), flush=True)
    if "fit_time" not in args.skip:
        report["fit_time"] = _fit_time(args)
        print(json.dumps(report["fit_time"], indent=1), flush=True)
    _write(report, args.out_dir)
    return report


def _fit_time(args) -> dict:
    """`pipelines.fit` on the Banking77 train split against `pipelines.classify` of the same
    rows with the head it wrote, each a DirectRunner run in its own process, one after the other."""
    import subprocess

    out = tempfile.mkdtemp(prefix="heads-bench-")
    train = os.path.join(DATA, "banking77", "train.csv")
    head = os.path.join(out, "banking77.head")
    task = os.path.join(out, "banking77_head.yaml")
    text = open(os.path.join(TASKS, "banking77_head.yaml"), encoding="utf-8").read()
    with open(task, "w", encoding="utf-8") as f:
        f.write(text.replace("head: banking77.head", f"head: {head}"))
    common = ["--runner=DirectRunner", f"--model={args.model}", "--batch_size=64"]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipelines.fit", *common, f"--task={task}", f"--input={train}",
                    "--label_column=category", f"--output={head}"], check=True, capture_output=True)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipelines.classify", *common, f"--task={task}", f"--input={train}",
                    f"--output={out}/labeled", "--prob_columns=false"], check=True, capture_output=True)
    classify_s = time.perf_counter() - start
    return {"rows": 10003, "fit_wall_s": round(fit_s, 1), "classify_wall_s": round(classify_s, 1),
            "fit / classify": round(fit_s / classify_s, 3)}


def _write(report: dict, out_dir: str) -> None:
    """heads.json and heads.md; a section this run skipped keeps the previous run's (with
    that run's date under ``sections_from``)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "heads.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        for section in ("accuracy", "head_metrics", "cost", "fit_time"):
            if section not in report and section in old:
                report[section] = old[section]
                report.setdefault("sections_from", {})[section] = old.get("sections_from", {}).get(section,
                                                                                                   old["date"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    lines = [f"# Trained heads ({report['date']}, {report['model']}, {report['cpus']} CPUs)", ""]
    kept = [f"{section} from the run of {date}" for section, date in report.get("sections_from", {}).items()]
    lines += [f"({'; '.join(kept)})", ""] if kept else []
    if "accuracy" in report:
        lines += ["| accuracy (rows that fit nothing) | |", "| --- | --- |"]
        lines += [f"| {k} | {v:.1%} |" for k, v in report["accuracy"].items()]
    if "cost" in report:
        lines += ["", "| per-row cost, batch 64, best of interleaved rounds | ms/row | prefix tokens |",
                  "| --- | --- | --- |"]
        lines += [f"| {k} | {v} | {report['cost']['prefix_tokens'][k]} |"
                  for k, v in report["cost"]["ms_per_row_best"].items()]
    if "fit_time" in report:
        t = report["fit_time"]
        lines += ["", f"Fitting {t['rows']:,} rows: {t['fit_wall_s']} s; classifying them with the head: "
                      f"{t['classify_wall_s']} s ({t['fit / classify']}x)."]
    with open(os.path.join(out_dir, "heads.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    run()
