"""`pipelines.fit` without feature flags: the head's features chosen by folds.

The candidates (`beam_prefix.engines.feature_search.candidates`: layer 1, a middle layer
and a middle pair, mean-pooled; the final state at the last position) are read by one
feature pass (their `union`), each candidate's head is fit on the same folds of the
training rows (the n-gram weight chosen by those folds too, 0 meaning none; with
`--label_rows auto`, the default, once with the task's label rows and once without), each
candidate's features are timed on this machine (the launcher loads the model once and
times a batch of the training texts per candidate, the best of interleaved rounds), and
`feature_search.choose` keeps the most accurate, or the cheapest within `--prefer`'s
margin of it. What was compared and chosen goes into the summary, the console's table
and the head file's metrics.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from beam_prefix.engines.feature_search import PREFER_MARGINS, Candidate, choose, slice_features, time_candidates
from beam_prefix.engines.head_fitting import fit_head_from_features
from beam_prefix.model.loading import precision_of
from beam_prefix.tasks.trained_head import feature_fingerprint

__all__ = ["fit_candidates", "with_or_without_label_rows", "ms_per_row", "TIMED_ROWS"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.fit")
TIMED_ROWS = 32  # the batch each candidate's features are timed on


def fit_candidates(found: Sequence[Candidate], layers: Sequence[int], features: np.ndarray, labels: list[str],
                   hashes: list[int], task, *, prompt: str, dtype: str, folds: int, texts, extra, prefer: str,
                   costs: dict[Candidate, float], label_rows: str = "false"):
    """Fit every candidate's head on its slice of the union `features` (rows and folds the
    same for all), choose one; returns (the chosen head, the summary's ``candidates`` and
    ``chosen``). `extra`: the label rows as `fit_head_from_features` takes them, on the union;
    `label_rows` ``auto`` fits each candidate with them and without (they never enter a
    held-out fold, so the same folds judge both), ``true`` only with them."""
    variants = [False] if extra is None else {"true": [True], "false": [False], "auto": [False, True]}[label_rows]
    heads, accuracy, cost = {}, {}, {}
    for c in found:
        for with_rows in variants:
            more = slice_features(extra[0], layers, c) if with_rows else None
            key = (c, with_rows)
            heads[key] = fit_head_from_features(
                slice_features(features, layers, c), labels, hashes, task, layers=c.layers,
                fingerprint=feature_fingerprint(prompt, precision_of(dtype), c.layers, c.pooling), folds=folds,
                pooling=c.pooling, texts=texts, extra=(more, *extra[1:]) if with_rows else None, dtype=dtype)
            # (a label with one row: no folds; every candidate then ties at 0 and the cheapest wins)
            accuracy[key] = heads[key].metrics.get("kfold_accuracy") or 0.0
            cost[key] = costs.get(c, float("inf"))
            _LOGGER.info("candidate %s%s: %s-fold accuracy %s, %.2f ms/row", c.name,
                         " with label rows" if with_rows else "", heads[key].metrics.get("folds"),
                         heads[key].metrics.get("kfold_accuracy"), costs.get(c, float("nan")))
    chosen, chosen_rows = choose(accuracy, cost, prefer)  # (equal cost and accuracy: without label rows)
    table = [{"layers": list(c.layers), "pooling": c.pooling, "dtype": dtype, "label_rows": with_rows,
              "ngrams": heads[c, with_rows].lexical is not None,
              "lexical_alpha": heads[c, with_rows].lexical.alpha if heads[c, with_rows].lexical is not None else 0.0,
              "fold_accuracy": heads[c, with_rows].metrics.get("kfold_accuracy"),
              "fold_accuracy_hidden_states": heads[c, with_rows].metrics.get("kfold_accuracy_hidden_states"),
              "ms_per_row": round(costs[c], 3) if c in costs else None} for c, with_rows in heads]
    said = {"layers": list(chosen.layers), "pooling": chosen.pooling, "dtype": dtype, "label_rows": chosen_rows,
            "prefer": prefer, "margin": PREFER_MARGINS[prefer]}
    if all(h.metrics.get("kfold_accuracy") is None for h in heads.values()):
        said["note"] = (f"no folds ran ({heads[chosen, chosen_rows].metrics.get('note') or 'too few rows per label'}), "
                        f"so no candidate's accuracy was measured: the cheapest was kept, whatever --prefer says; "
                        f"add rows, or choose with --layers and --pooling")
    head = heads[chosen, chosen_rows]
    head.metrics["feature_search"] = {"candidates": table, "chosen": said}  # (the head file records it)
    return head, table, said


def with_or_without_label_rows(fit: Callable[[object], object], extra, label_rows: str):
    """One head for explicitly chosen features: `fit(extra)` with the label rows, without, or
    (``auto``) both, the better by fold accuracy kept (a tie: without). Returns (the head,
    each variant's fold accuracy by ``with``/``without``, or None with one variant)."""
    if extra is None or label_rows != "auto":
        return fit(extra if label_rows == "true" else None), None
    heads = {False: fit(None), True: fit(extra)}  # (the search's rule: same cost, the more accurate, else the first)
    kept = choose({k: h.metrics.get("kfold_accuracy") or 0.0 for k, h in heads.items()}, dict.fromkeys(heads, 0.0),
                  "accuracy")
    return heads[kept], {"without": heads[False].metrics.get("kfold_accuracy"),
                         "with": heads[True].metrics.get("kfold_accuracy")}


def ms_per_row(model: str, dtype: str, task, texts: Sequence[str], found: Sequence[Candidate]) -> dict:
    """Each candidate's features per row on this machine, in milliseconds: the model loaded
    here once, `TIMED_ROWS` of `texts` embedded per candidate (its own early exit), the
    best of interleaved rounds (`feature_search.time_candidates`)."""
    from beam_prefix import PrefixClassifier
    from beam_prefix.beam.embed_transform import features_task
    from beam_prefix.model.loading import load_model

    clf = PrefixClassifier(task=features_task(task), loaded=load_model(model, dtype=dtype), verify=False)
    encoded = [clf.encode(t) for t in list(texts)[:TIMED_ROWS]]
    per_call = time_candidates(lambda c: clf.embed_encoded(encoded, layers=c.layers, pooling=c.pooling), found)
    return {c: ms / len(encoded) for c, ms in per_call.items()}


def format_table(table: list[dict], chosen: dict) -> str:
    """The console's table of the candidates, the chosen one marked."""
    lines = [f"features chosen by folds (--prefer {chosen['prefer']}: the cheapest within "
             f"{chosen['margin'] * 100:g} points of the best fold accuracy):",
             "  candidate              label rows  fold acc.  hidden only  n-grams  ms/row"]
    for row in table:
        mine = (row["layers"], row["pooling"], row.get("label_rows", False))
        mark = "*" if mine == (chosen["layers"], chosen["pooling"], chosen.get("label_rows", False)) else " "
        name = f"layers {','.join(map(str, row['layers']))} {row['pooling']}"
        acc = "-" if row["fold_accuracy"] is None else f"{row['fold_accuracy']:.1%}"
        hidden = "-" if row["fold_accuracy_hidden_states"] is None else f"{row['fold_accuracy_hidden_states']:.1%}"
        ms = "-" if row["ms_per_row"] is None else f"{row['ms_per_row']:.2f}"
        rows = "with" if row.get("label_rows") else "without"
        lines.append(f"{mark} {name:<21} {rows:>10}  {acc:>9}  {hidden:>11}  {row['lexical_alpha']:>7g}  {ms:>6}")
    if chosen.get("note"):
        lines.append(f"  {chosen['note']}")
    return "\n".join(lines)
