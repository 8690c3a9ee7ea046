"""How deep must the forward go for a Banking77 head? Fold accuracy per last layer read (#35).

    python -m benchmarks.layer_survey [--out_dir benchmarks/results] [--features FILE.npz]
        [--layers 3,6,...,-1] [--candidates "6;3,6;..."] [--label_row_candidates "6,12;..."] [--name layer_survey]

A head that reads no layer past k lets the engine stop the forward after layer k
(`beam_prefix.model.early_exit`): its cost falls to about k/30 of the embedded model's layers. This
survey says what each k costs in accuracy, on the **training rows only** (the choice of the
shipped head's layers may use it; the test rows are not read): the banking77_head prompt's
mean-pooled states of layers 3, 6, ..., 27 and the final one (-1), computed once by the
cached engine (what a head reads), then for each k a multinomial logistic regression (torch,
standardised features, L2 1e-4) on each candidate set of layers (`CANDIDATES`), out-of-fold
over the same 5 stratified folds as `fit_head`, combined with the n-gram part's out-of-fold
log-probabilities (`lexical_head.fit_lexical`) weighed by the best of a grid; and for the
two shipped heads' layers, with the task's label rows (`fit_head(label_rows=True)`: each
intent's name as text) added to every fold's training rows, never held out.

Both regimes of `benchmarks.baselines`: the full train split and 10 rows per intent.
`--layers` (the layers whose states are computed), `--candidates` and
`--label_row_candidates` (sets of them, `;`-separated; an empty value runs none) survey other
layers, e.g. the heads below layer 6. Writes `<name>.json` and `<name>.md` under `--out_dir`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from benchmarks.baselines import _few
from benchmarks.data import DATA, RESULTS, TASKS, csv_rows, write_results
from beam_prefix.pipelines.options import join_negative_lists

SURVEYED = (3, 6, 9, 12, 15, 18, 21, 24, 27, -1)
ALPHAS = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0)
# cheapest first; the last is the shipped head's (layers 6..24 and the final state)
CANDIDATES = ((6,), (3, 6), (6, 9), (6, 12), (6, 12, 18), (6, 12, 18, 24, -1))
LABEL_ROW_CANDIDATES = ((6, 12), (6, 12, 18, 24, -1))  # the two shipped heads' layers


def _classifier():
    from beam_prefix import PrefixClassifier, TaskSpec
    from beam_prefix.model import load_model

    task = TaskSpec.from_yaml(os.path.join(TASKS, "banking77_head.yaml")).replace(scoring="auto", head=None)
    return PrefixClassifier(task=task, loaded=load_model("embedded"), batch_size=64, verify=False)


def _label_rows(surveyed=SURVEYED):
    """The banking77_head task's label rows (`head_fitting.task_label_rows`) and their features."""
    from beam_prefix.engines.head_fitting import task_label_rows

    clf = _classifier()
    texts, labels = task_label_rows(clf.task)
    x = np.stack([e.features for e in clf.embed(texts, layers=surveyed, pooling="mean")]).astype(np.float16)
    return x, texts, labels


def _features(texts, path, surveyed=SURVEYED):
    if path and os.path.exists(path):
        kept = np.load(path)
        if "layers" not in kept or tuple(kept["layers"].tolist()) != tuple(surveyed):
            raise SystemExit(f"--features {path}: computed for layers "
                             f"{kept['layers'].tolist() if 'layers' in kept else 'not recorded'}, not {list(surveyed)}")
        return kept["x"]
    clf = _classifier()
    start = time.perf_counter()
    x = np.stack([e.features for e in clf.embed_encoded([clf.encode(t) for t in texts], layers=surveyed,
                                                         pooling="mean")]).astype(np.float16)
    print(f"features of {len(texts)} rows: {time.perf_counter() - start:.0f} s", flush=True)
    if path:
        np.savez(path, x=x, layers=np.array(surveyed))
    return x


def _oof(x, y, n, folds, l2=1e-4, iters=100):
    """Out-of-fold log-probabilities ``[N, n]`` of a standardised logistic regression (N:
    the rows the folds hold out; rows past them only ever train)."""
    out = np.zeros((sum(len(held) for _, held in folds), n), dtype=np.float32)
    for train, held in folds:
        xt = torch.from_numpy(x[train]).float()
        mean, std = xt.mean(0), xt.std(0).clamp_min(1e-6)
        xt = (xt - mean) / std
        yt = torch.from_numpy(y[train])
        w = torch.zeros(xt.shape[1], n, requires_grad=True)
        b = torch.zeros(n, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(xt @ w + b, yt) + l2 * (w * w).sum()
            loss.backward()
            return loss
        opt.step(closure)
        with torch.no_grad():
            xh = (torch.from_numpy(x[held]).float() - mean) / std
            out[held] = torch.log_softmax(xh @ w + b, -1).numpy()
    return out


def survey(x, texts, labels, extra=None, *, surveyed=SURVEYED, candidates=CANDIDATES,
           label_row_candidates=LABEL_ROW_CANDIDATES):
    """Fold accuracy per candidate; with `extra` (the task's label rows: features, texts,
    labels), also for `label_row_candidates` with them added to every fold's training rows.
    `x`: ``[N, len(surveyed) * hidden]``, the states of `surveyed` side by side."""
    from sklearn.model_selection import StratifiedKFold

    from beam_prefix.tasks.lexical_head import fit_lexical

    names = sorted(set(labels))
    y = np.array([names.index(v) for v in labels])
    cv = StratifiedKFold(n_splits=5, shuffle=True, random_state=0)
    folds = list(cv.split(np.zeros(len(y)), y))
    _, lexical = fit_lexical(texts, y, len(names), cv=cv)
    rows = _candidates(x, y, names, folds, lexical, candidates, "", surveyed)
    if extra is not None and label_row_candidates:
        ex, et, el = extra
        n = len(y)
        x, y = np.concatenate([x, ex]), np.concatenate([y, [names.index(v) for v in el]])
        folds = [(np.concatenate([train, np.arange(n, len(y))]), held) for train, held in folds]
        _, lexical = fit_lexical(list(texts) + list(et), y, len(names), cv=folds)
        rows += _candidates(x, y, names, folds, lexical, label_row_candidates, "label rows", surveyed)
    return rows


def _candidates(x, y, names, folds, lexical, candidates, note, surveyed=SURVEYED):
    h = x.shape[1] // len(surveyed)
    scored = len(lexical)
    rows = []
    for chosen in candidates:
        cols = np.concatenate([np.arange(surveyed.index(l) * h, (surveyed.index(l) + 1) * h) for l in chosen])
        start = time.perf_counter()
        oof = _oof(x[:, cols], y, len(names), folds)
        by_alpha = {a: round(float(((oof + a * lexical).argmax(1) == y[:scored]).mean()), 4) for a in ALPHAS}
        best = max(ALPHAS, key=lambda a: (by_alpha[a], -a))
        last = max(30 if l == -1 else l for l in chosen)
        rows.append({"last_layer": last, "layers": list(chosen), "hidden_states": by_alpha[0.0], "note": note,
                     "best_alpha": best, "with_ngrams": by_alpha[best], "by_alpha": by_alpha})
        print(f"layers {chosen} {note}: {by_alpha[0.0]:.4f} alone, {by_alpha[best]:.4f} with n-grams x{best:g} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def _layer_sets(value: str) -> tuple[tuple[int, ...], ...]:
    """``"6;3,6"`` -> ``((6,), (3, 6))``; an empty value -> no sets."""
    return tuple(tuple(int(v) for v in part.split(",")) for part in value.split(";") if part.strip())


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default=RESULTS)
    parser.add_argument("--features", default=None,
                        help="an .npz to keep the train rows' features in (reused; computed for --layers)")
    parser.add_argument("--layers", default=",".join(map(str, SURVEYED)),
                        help="the layers whose mean-pooled states are computed (comma-separated)")
    parser.add_argument("--candidates", default=";".join(",".join(map(str, c)) for c in CANDIDATES),
                        help="the layer sets surveyed, ';'-separated, each within --layers")
    parser.add_argument("--label_row_candidates", default=";".join(",".join(map(str, c)) for c in LABEL_ROW_CANDIDATES),
                        help="the layer sets surveyed with the task's label rows too ('' for none)")
    parser.add_argument("--name", default="layer_survey", help="report file name (without .json/.md)")
    args = parser.parse_args(join_negative_lists(list(sys.argv[1:] if argv is None else argv), ("--layers",)))
    surveyed = tuple(int(v) for v in args.layers.split(","))
    candidates, label_row_candidates = _layer_sets(args.candidates), _layer_sets(args.label_row_candidates)
    outside = sorted({l for c in candidates + label_row_candidates for l in c} - set(surveyed))
    if outside:
        raise SystemExit(f"--candidates/--label_row_candidates name layers {outside} not in --layers {args.layers}")
    train = csv_rows(os.path.join(DATA, "banking77", "train.csv"), label="category")
    x = _features([t for t, _ in train], args.features, surveyed)
    index = {id(r): i for i, r in enumerate(train)}
    few = _few(train)
    extra = _label_rows(surveyed) if label_row_candidates else None
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "surveyed": list(surveyed),
              "regimes": {}}
    for regime, rows in (("10 rows per intent", few), ("full train", train)):  # the quick one first
        print(regime, flush=True)
        picked = [index[id(r)] for r in rows]
        report["regimes"][regime] = survey(x[picked], [t for t, _ in rows], [g for _, g in rows], extra,
                                           surveyed=surveyed, candidates=candidates,
                                           label_row_candidates=label_row_candidates)
        _write(report, args.out_dir, args.name)
    return report


def _write(report, out_dir, name="layer_survey"):
    lines = [f"# Banking77 heads by the last layer they read ({report['date']}, {report['cpus']} CPUs)", "",
             "5-fold out-of-fold accuracy on the training rows (test rows not read): mean-pooled states of the "
             "banking77_head prompt, logistic regression, with the n-gram part weighed by the best alpha. "
             "Layer 30 is the final (normalised) state, -1.", "",
             "| regime | last layer | layers | also trained on | hidden states | with n-grams (alpha) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for regime, rows in report["regimes"].items():
        for r in rows:
            lines.append(f"| {regime} | {r['last_layer']} | {r['layers']} | {r.get('note') or '-'} | "
                         f"{r['hidden_states']:.4f} | {r['with_ngrams']:.4f} ({r['best_alpha']:g}) |")
    write_results(out_dir, name, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    run()
