"""`pipelines.fit` without feature flags: the head's features chosen by folds.

The candidates (`beam_prefix.engines.feature_search.candidates`: layer 1, a middle layer
and a middle pair, mean-pooled; the final state at the last position) are read by one
feature pass (their `union`), each candidate's head is fit on the same folds of the
training rows (the n-gram weight chosen by those folds too, 0 meaning none), each
candidate's features are timed on this machine (the launcher loads the model once and
times a batch of the training texts per candidate, interleaved rounds), and
`feature_search.choose` keeps the most accurate, or the cheapest within `--prefer`'s
margin of it. What was compared and chosen goes into the summary, the console's table
and the head file's metrics.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from beam_prefix.engines.feature_search import PREFER_MARGINS, Candidate, choose, slice_features, time_candidates
from beam_prefix.engines.head_fitting import fit_head_from_features
from beam_prefix.model.loading import precision_of
from beam_prefix.tasks.trained_head import feature_fingerprint

__all__ = ["fit_candidates", "ms_per_row", "TIMED_ROWS"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.fit")
TIMED_ROWS = 32  # the batch each candidate's features are timed on


def fit_candidates(found: Sequence[Candidate], layers: Sequence[int], features: np.ndarray, labels: list[str],
                   hashes: list[int], task, *, prompt: str, dtype: str, folds: int, texts, extra, prefer: str,
                   costs: dict[Candidate, float]):
    """Fit every candidate's head on its slice of the union `features` (rows and folds the
    same for all), choose one; returns (the chosen head, the summary's ``candidates`` and
    ``chosen``). `extra`: the label rows as `fit_head_from_features` takes them, on the union."""
    heads, accuracy = {}, {}
    for c in found:
        more = None if extra is None else (slice_features(extra[0], layers, c), *extra[1:])
        heads[c] = fit_head_from_features(
            slice_features(features, layers, c), labels, hashes, task, layers=c.layers,
            fingerprint=feature_fingerprint(prompt, precision_of(dtype), c.layers, c.pooling), folds=folds,
            pooling=c.pooling, texts=texts, extra=more, dtype=dtype)
        # (a label with one row: no folds; every candidate then ties at 0 and the cheapest wins)
        accuracy[c] = heads[c].metrics.get("kfold_accuracy") or 0.0
        _LOGGER.info("candidate %s: %s-fold accuracy %s, %.2f ms/row", c.name, heads[c].metrics.get("folds"),
                     heads[c].metrics.get("kfold_accuracy"), costs.get(c, float("nan")))
    chosen = choose(accuracy, costs, prefer)
    table = [{"layers": list(c.layers), "pooling": c.pooling, "dtype": dtype,
              "ngrams": heads[c].lexical is not None,
              "lexical_alpha": heads[c].lexical.alpha if heads[c].lexical is not None else 0.0,
              "fold_accuracy": heads[c].metrics.get("kfold_accuracy"),
              "fold_accuracy_hidden_states": heads[c].metrics.get("kfold_accuracy_hidden_states"),
              "ms_per_row": round(costs[c], 3) if c in costs else None} for c in found]
    said = {"layers": list(chosen.layers), "pooling": chosen.pooling, "dtype": dtype, "prefer": prefer,
            "margin": PREFER_MARGINS[prefer]}
    if all(heads[c].metrics.get("kfold_accuracy") is None for c in found):
        said["note"] = (f"no folds ran ({heads[chosen].metrics.get('note') or 'too few rows per label'}), so no "
                        f"candidate's accuracy was measured: the cheapest was kept, whatever --prefer says; "
                        f"add rows, or choose with --layers and --pooling")
    head = heads[chosen]
    head.metrics["feature_search"] = {"candidates": table, "chosen": said}  # (the head file records it)
    return head, table, said


def ms_per_row(model: str, dtype: str, task, texts: Sequence[str], found: Sequence[Candidate]) -> dict:
    """Each candidate's features per row on this machine, in milliseconds: the model loaded
    here once, `TIMED_ROWS` of `texts` embedded per candidate (its own early exit), the
    median of interleaved rounds (`feature_search.time_candidates`)."""
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
             "  candidate              fold acc.  hidden only  n-grams  ms/row"]
    for row in table:
        mark = "*" if (row["layers"], row["pooling"]) == (chosen["layers"], chosen["pooling"]) else " "
        name = f"layers {','.join(map(str, row['layers']))} {row['pooling']}"
        acc = "-" if row["fold_accuracy"] is None else f"{row['fold_accuracy']:.1%}"
        hidden = "-" if row["fold_accuracy_hidden_states"] is None else f"{row['fold_accuracy_hidden_states']:.1%}"
        ms = "-" if row["ms_per_row"] is None else f"{row['ms_per_row']:.2f}"
        lines.append(f"{mark} {name:<21} {acc:>9}  {hidden:>11}  {row['lexical_alpha']:>7g}  {ms:>6}")
    if chosen.get("note"):
        lines.append(f"  {chosen['note']}")
    return "\n".join(lines)
