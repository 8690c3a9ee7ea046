"""Does tuning the model itself lift a Banking77 head at 10 rows per intent? (#35)

    python -m benchmarks.tuning_survey [--epochs 4] [--learning_rate 1e-4] [--layers 6,12] [--seed 0]
        [--out_dir benchmarks/results] [--name tuning_survey]

Measured on **training rows only**: the 770 rows of `benchmarks.baselines`' 10-per-intent
regime tune and fit; 1,000 other rows of the train split (seed 1), which tune and fit
nothing, measure. The test split is not read.

Tuning: `beam_prefix.engines.model_tuning.tune_model` (what `pipelines.tune` runs): the
decoder layers up to the deepest one the head reads (`--layers`; banking77_fast_head's 6,12:
layers 1-12 of 30), AdamW, a supervised contrastive loss on exactly the features the head reads, through
the engine's own forward. The tuned model is saved as a model directory and loaded as any
other; its heads are fit with `fit_head` (label rows, n-grams weighed by folds) as the
untuned one's.

Reported for the untuned and the tuned model: `fit_head`'s validation accuracy (what
`pipelines.fit` would ship) and, because `fit_head`'s folds run over rows the tuned model
was trained on (so they overrate its hidden states and underweigh the n-grams), a grid of
logistic-regression C and n-gram weight on the validation rows.
Writes `<name>.json` and `<name>.md` under `--out_dir`.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import numpy as np

from benchmarks.baselines import _few
from beam_prefix.model.tuning_record import LABELS_PER_BATCH
from benchmarks.data import DATA, RESULTS, TASKS, csv_rows, write_results

LAYERS = (6, 12)
GRID_C = (0.01, 0.1, 1.0)
GRID_ALPHA = (0.0, 0.5, 1.0, 2.0)


def tune(task, rows, *, epochs: int, learning_rate: float, temperature: float, out: str, seed: int = 0,
         spec: str = "embedded", labels_per_batch: int = LABELS_PER_BATCH, layers=LAYERS) -> list[float]:
    """`model_tuning.tune_model` on `rows` (what `pipelines.tune` runs)."""
    from beam_prefix.engines.model_tuning import tune_model

    record = tune_model(task, [t for t, _ in rows], [g for _, g in rows], output_dir=out, model=spec, layers=layers,
                        pooling="mean", epochs=epochs, learning_rate=learning_rate, temperature=temperature,
                        seed=seed, labels_per_batch=labels_per_batch, log=print)
    return list(record.losses)


def measure(spec: str, task, few, val, lexical_alpha: float | None = None, layers=LAYERS) -> dict:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from beam_prefix import PrefixClassifier, fit_head
    from beam_prefix.engines.head_fitting import task_label_rows
    from beam_prefix.model import load_model
    from beam_prefix.tasks.lexical_head import fit_lexical

    loaded = load_model(spec)
    base = PrefixClassifier(task=task, loaded=loaded, batch_size=64, verify=False)
    head = fit_head(base, [t for t, _ in few], [g for _, g in few], layers=layers, pooling="mean", label_rows=True,
                    lexical_alpha=lexical_alpha)
    clf = PrefixClassifier(task=task.replace(scoring="head", head=head), loaded=loaded, batch_size=64, verify=False)
    shipped = np.mean([p.label == g for p, (_, g) in zip(clf.classify([t for t, _ in val]), val)])
    names = list(task.label_names)
    label_texts, label_labels = task_label_rows(task)
    texts = [t for t, _ in few] + label_texts
    y = np.array([names.index(g) for g in [g for _, g in few] + label_labels])
    y_val = np.array([names.index(g) for _, g in val])
    embed = lambda ts: np.asarray([e.features for e in base.embed(ts, layers, pooling="mean")], dtype=np.float32)
    x, x_val = embed(texts), embed([t for t, _ in val])
    scale = StandardScaler().fit(x[:len(few)])
    lexical = fit_lexical(texts, y, len(names))[0].log_probs([t for t, _ in val]).numpy()
    grid = {}
    for c in GRID_C:
        logp = LogisticRegression(C=c, max_iter=2000).fit(scale.transform(x), y).predict_log_proba(scale.transform(x_val))
        for a in GRID_ALPHA:
            grid[f"C={c} alpha={a}"] = round(float(((logp + a * lexical).argmax(1) == y_val).mean()), 4)
    return {"fit_head_val_accuracy": round(float(shipped), 4), "fit_head_kfold": head.metrics.get("kfold_accuracy"),
            "fit_head_alpha": head.metrics.get("lexical_alpha"), "fit_head_C": head.metrics.get("C"),
            "grid_val_accuracy": grid, "grid_best": max(grid.values())}


def run(argv=None) -> dict:
    from beam_prefix import TaskSpec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--labels_per_batch", type=int, default=LABELS_PER_BATCH)
    parser.add_argument("--val_rows", type=int, default=1000)
    parser.add_argument("--layers", default=",".join(map(str, LAYERS)),
                        help="hidden-state layers the head reads (comma-separated); tuning changes layers 1 to the deepest")
    parser.add_argument("--seed", type=int, default=0, help="the tuning's seed (batches, order); the rows stay fixed")
    parser.add_argument("--out_dir", default=RESULTS)
    parser.add_argument("--name", default="tuning_survey", help="report file name (without .json/.md)")
    parser.add_argument("--label_rows_in_tuning", action="store_true",
                        help="the task's label rows (each intent's name as text) join the tuning rows too")
    args = parser.parse_args(argv)
    layers = tuple(int(v) for v in args.layers.split(","))
    train = csv_rows(os.path.join(DATA, "banking77", "train.csv"), label="category")
    few = _few(train)
    chosen = set(few)
    val = random.Random(1).sample([r for r in train if r not in chosen], args.val_rows)
    task = TaskSpec.from_yaml(os.path.join(TASKS, "banking77_fast_head.yaml")).replace(scoring="auto", head=None)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "few": len(few), "val": len(val),
              "layers": list(layers), "seed": args.seed, "epochs": args.epochs, "learning_rate": args.learning_rate,
              "temperature": args.temperature, "labels_per_batch": args.labels_per_batch,
              "label_rows_in_tuning": args.label_rows_in_tuning,
              "untuned": measure("embedded", task, few, val, layers=layers)}
    print("untuned:", report["untuned"]["fit_head_val_accuracy"], report["untuned"]["grid_best"], flush=True)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        from beam_prefix.engines.head_fitting import task_label_rows

        rows = few + (list(zip(*task_label_rows(task))) if args.label_rows_in_tuning else [])
        report["losses"] = tune(task, rows, epochs=args.epochs, learning_rate=args.learning_rate,
                                temperature=args.temperature, out=out, labels_per_batch=args.labels_per_batch,
                                seed=args.seed, layers=layers)
        report["tune_s"] = round(time.perf_counter() - start, 1)
        # its head as pipelines.tune fits it: the n-gram weight the base model's folds chose
        report["tuned"] = measure(out, task, few, val, lexical_alpha=report["untuned"]["fit_head_alpha"],
                                  layers=layers)
    print("tuned:", report["tuned"]["fit_head_val_accuracy"], report["tuned"]["grid_best"], flush=True)
    write_results(args.out_dir, args.name, report, _markdown(report), indent=2)
    return report


def _markdown(r: dict) -> str:
    u, t = r["untuned"], r["tuned"]
    lines = [f"# Tuning the embedded model on 10 rows per intent ({r['date']}, {r['cpus']} CPUs)", "",
             f"Training rows only: {r['few']} rows tune and fit, {r['val']} other training rows measure "
             f"(the test split is not read). Layers 1-{max(r['layers'])} tuned, {r['epochs']} epochs, "
             f"AdamW {r['learning_rate']}, seed {r.get('seed', 0)}, batches of 4 rows of {r.get('labels_per_batch', LABELS_PER_BATCH)} labels, "
             f"supervised contrastive loss (temperature {r['temperature']}) on the "
             f"mean-pooled states of layers {r['layers']}"
             + (", the task's label rows in the tuning rows too" if r.get("label_rows_in_tuning") else "")
             + f"; {r['tune_s']} s; loss per epoch {r['losses']}.", "",
             "| model | fit_head (label rows; tuned: the base model's n-gram weight, as pipelines.tune): validation | its 5-fold | its n-gram weight | best of the C x n-gram grid |",
             "| --- | --- | --- | --- | --- |"]
    for name, m in (("untuned", u), ("tuned", t)):
        lines.append(f"| {name} | {m['fit_head_val_accuracy']:.1%} | {m['fit_head_kfold']} | {m['fit_head_alpha']} | "
                     f"{m['grid_best']:.1%} |")
    lines += ["", "Grid (validation accuracy, C of the hidden-state regression x weight of the n-grams):", "",
              "| | " + " | ".join(u["grid_val_accuracy"]) + " |", "|---" * (len(u["grid_val_accuracy"]) + 1) + "|"]
    for name, m in (("untuned", u), ("tuned", t)):
        lines.append(f"| {name} | " + " | ".join(f"{v:.1%}" for v in m["grid_val_accuracy"].values()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run()
