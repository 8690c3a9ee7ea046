"""`pipelines.fit` without feature flags: the head's features, and their precision, chosen by folds.

The candidates (`beam_prefix.engines.feature_search.candidates`: layer 1, a middle layer
and a middle pair, mean-pooled; the final state at the last position) are read by one
feature pass (their `union`) per precision searched (`precisions`: float32, and bfloat16
too where this machine computes it natively, with ``--dtype auto``, the default), each
candidate's head is fit on the same folds of the training rows (the n-gram weight chosen
by those folds too, 0 meaning none; with `--label_rows auto`, the default, once with the
task's label rows and once without), each candidate's features are timed on this machine
in each precision (the launcher loads the model once per precision and times a batch of
the training texts per candidate, the best of rounds interleaved across every candidate
and precision, so another process waking up cannot reorder them), and
`feature_search.choose` keeps the most accurate, or the cheapest within `--prefer`'s
margin of it. What was compared and chosen goes into the summary, the console's table
and the head file's metrics; the head records its precision, which classify then runs in.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from beam_prefix.engines.feature_search import PREFER_MARGINS, Candidate, choose, slice_features, time_candidates
from beam_prefix.engines.head_fitting import fit_head_from_features
from beam_prefix.model.half_precision import native_bf16
from beam_prefix.model.loading import precision_of
from beam_prefix.tasks.trained_head import feature_fingerprint

__all__ = ["fit_candidates", "with_or_without_label_rows", "ms_per_row", "precisions", "TIMED_ROWS"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.fit")
TIMED_ROWS = 32  # the batch each candidate's features are timed on


def precisions(dtype: str | None, device: str, search: bool) -> tuple[list[str], str]:
    """The precisions a fit compares, and why: the one `dtype` names; with ``auto`` (or
    none) float32, and bfloat16 too where it is native here (a CPU with AVX512-BF16 or AMX,
    a GPU device), when the features are searched (`search`; named features: float32)."""
    if dtype not in (None, "auto"):
        return [dtype], f"--dtype {dtype}"
    if not search:
        return ["float32"], "float32: --layers or --pooling names the features (precision is searched with them)"
    gpu = device.startswith("cuda") or (device == "auto" and _cuda())
    if gpu:
        return ["float32", "bfloat16"], f"float32 and bfloat16: --device {device} is a GPU"
    if native_bf16():
        return ["float32", "bfloat16"], "float32 and bfloat16: this CPU computes bf16 natively (AVX512-BF16 or AMX)"
    return ["float32"], "float32 only: this CPU has no native bf16, where bf16 runs slower than float32"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def fit_candidates(found: Sequence[Candidate], layers: Sequence[int], by_dtype: dict, labels: list[str],
                   hashes: list[int], task, *, prompt: str, folds: int, texts, prefer: str,
                   costs: dict[tuple[Candidate, str], float], label_rows: str = "false", why: str = ""):
    """Fit every candidate's head, in every precision, on its slice of the union features
    (rows and folds the same for all), choose one; returns (the chosen head, the summary's
    ``candidates`` and ``chosen``). `by_dtype`: per precision, (the union features ``[N,
    F]``, the label rows as `fit_head_from_features` takes them on the union, or None);
    `costs`: ms/row by (candidate, precision); `label_rows` ``auto`` fits each candidate with
    them and without (they never enter a held-out fold, so the same folds judge both),
    ``true`` only with them; `why`: why these precisions (`precisions`)."""
    heads, accuracy, cost = {}, {}, {}
    for dtype, (features, extra) in by_dtype.items():
        variants = [False] if extra is None else {"true": [True], "false": [False], "auto": [False, True]}[label_rows]
        for c in found:
            for with_rows in variants:
                more = slice_features(extra[0], layers, c) if with_rows else None
                key = (c, with_rows, dtype)
                heads[key] = fit_head_from_features(
                    slice_features(features, layers, c), labels, hashes, task, layers=c.layers,
                    fingerprint=feature_fingerprint(prompt, precision_of(dtype), c.layers, c.pooling), folds=folds,
                    pooling=c.pooling, texts=texts, extra=(more, *extra[1:]) if with_rows else None, dtype=dtype)
                # (a label with one row: no folds; every candidate then ties at 0 and the cheapest wins)
                accuracy[key] = heads[key].metrics.get("kfold_accuracy") or 0.0
                cost[key] = costs.get((c, dtype), float("inf"))
                _LOGGER.info("candidate %s%s, %s: %s-fold accuracy %s, %.2f ms/row", c.name,
                             " with label rows" if with_rows else "", dtype, heads[key].metrics.get("folds"),
                             heads[key].metrics.get("kfold_accuracy"), costs.get((c, dtype), float("nan")))
    chosen, chosen_rows, chosen_dtype = choose(accuracy, cost, prefer)  # (ties: the first, float32 without label rows)
    table = [{"layers": list(c.layers), "pooling": c.pooling, "dtype": dtype, "label_rows": with_rows,
              "ngrams": heads[c, with_rows, dtype].lexical is not None,
              "lexical_alpha": (heads[c, with_rows, dtype].lexical.alpha
                                if heads[c, with_rows, dtype].lexical is not None else 0.0),
              "fold_accuracy": heads[c, with_rows, dtype].metrics.get("kfold_accuracy"),
              "fold_accuracy_hidden_states": heads[c, with_rows, dtype].metrics.get("kfold_accuracy_hidden_states"),
              "ms_per_row": round(costs[c, dtype], 3) if (c, dtype) in costs else None}
             for c, with_rows, dtype in heads]
    said = {"layers": list(chosen.layers), "pooling": chosen.pooling, "dtype": chosen_dtype, "label_rows": chosen_rows,
            "prefer": prefer, "margin": PREFER_MARGINS[prefer], "precisions": list(by_dtype), "precisions_why": why}
    if all(h.metrics.get("kfold_accuracy") is None for h in heads.values()):
        why_not = heads[chosen, chosen_rows, chosen_dtype].metrics.get("note") or "too few rows per label"
        said["note"] = (f"no folds ran ({why_not}), "
                        f"so no candidate's accuracy was measured: the cheapest was kept, whatever --prefer says; "
                        f"add rows, or choose with --layers and --pooling")
    head = heads[chosen, chosen_rows, chosen_dtype]
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


def ms_per_row(model: str, dtypes: Sequence[str], task, texts: Sequence[str], found: Sequence[Candidate]) -> dict:
    """Each candidate's features per row on this machine in each precision, in milliseconds,
    by (candidate, dtype): the model loaded here once per precision, `TIMED_ROWS` of `texts`
    embedded per candidate (its own early exit), the best of rounds interleaved across every
    candidate and precision (`feature_search.time_candidates`)."""
    from beam_prefix import PrefixClassifier
    from beam_prefix.beam.embed_transform import features_task
    from beam_prefix.model.loading import load_model

    clfs = {d: PrefixClassifier(task=features_task(task), loaded=load_model(model, dtype=d), verify=False)
            for d in dtypes}
    encoded = {d: [clf.encode(t) for t in list(texts)[:TIMED_ROWS]] for d, clf in clfs.items()}
    pairs = [(c, d) for d in dtypes for c in found]
    per_call = time_candidates(lambda pair: clfs[pair[1]].embed_encoded(encoded[pair[1]], layers=pair[0].layers,
                                                                         pooling=pair[0].pooling), pairs)
    return {pair: ms / len(encoded[pair[1]]) for pair, ms in per_call.items()}


def format_table(table: list[dict], chosen: dict) -> str:
    """The console's table of the candidates, the chosen one marked."""
    lines = [f"features chosen by folds (--prefer {chosen['prefer']}: the cheapest within "
             f"{chosen['margin'] * 100:g} points of the best fold accuracy):",
             f"  precision: {chosen.get('precisions_why') or 'float32'}",
             "  candidate              precision  label rows  fold acc.  hidden only  n-grams  ms/row"]
    for row in table:
        mine = (row["layers"], row["pooling"], row.get("label_rows", False), row.get("dtype", "float32"))
        mark = "*" if mine == (chosen["layers"], chosen["pooling"], chosen.get("label_rows", False),
                               chosen.get("dtype", "float32")) else " "
        name = f"layers {','.join(map(str, row['layers']))} {row['pooling']}"
        acc = "-" if row["fold_accuracy"] is None else f"{row['fold_accuracy']:.1%}"
        hidden = "-" if row["fold_accuracy_hidden_states"] is None else f"{row['fold_accuracy_hidden_states']:.1%}"
        ms = "-" if row["ms_per_row"] is None else f"{row['ms_per_row']:.2f}"
        rows = "with" if row.get("label_rows") else "without"
        lines.append(f"{mark} {name:<21} {row.get('dtype', 'float32'):>9}  {rows:>10}  {acc:>9}  {hidden:>11}  "
                     f"{row['lexical_alpha']:>7g}  {ms:>6}")
    if chosen.get("note"):
        lines.append(f"  {chosen['note']}")
    return "\n".join(lines)
