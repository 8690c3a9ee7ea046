"""The run summary: counts from Beam metrics, printed and written as JSON.

Counting steps (`CountRows`, `CountLabels`, `Evaluate`) add counters to the graph; once
the run finishes, `summarize` reads them back from the runner's metrics (so it works on
DirectRunner, the portable runner and Dataflow alike) and checks that every row read
ended in exactly one output. With gold labels, it adds accuracy and a confusion-matrix
PNG.
"""

from __future__ import annotations

import json
import logging
from typing import Sequence

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter

from beam_prefix.beam.metrics import NAMESPACE as LIBRARY_NAMESPACE

__all__ = ["NAMESPACE", "GOLD_KEY", "FIT_KEY", "STASHED_KEYS", "stash_gold", "count_rows", "LabelCounter", "RowCounter", "CountFailures", "summarize", "format_summary",
           "write_confusion_png", "write_json"]

_LOGGER = logging.getLogger(__name__)

NAMESPACE = "beam_prefix_pipeline"
# The gold label travels under this key: the input column may be called `label`, which the
# classification overwrites.
GOLD_KEY = "__gold_label__"
# Whether the row's text was one of the trained head's training rows: such a row is left out
# of the accuracy (never reported on rows that fit what is being measured).
FIT_KEY = "__fit_the_head__"
STASHED_KEYS = (GOLD_KEY, FIT_KEY)


def stash_gold(rows, column: str, *, heads=None, text_column: str = "text", task_column: str | None = None):
    """Copy each row's gold label to `GOLD_KEY` before classification; where the row's task
    answers with a trained head (`heads`: task key -> head; key None without routing,
    else the row's `task_column` value), mark (`FIT_KEY`) the rows whose text it was fit on."""
    return rows | "StashGoldLabel" >> beam.Map(_Stash(column, dict(heads or {}), text_column, task_column))


class _Stash:
    def __init__(self, column: str, heads: dict, text_column: str, task_column: str | None):
        self._column, self._heads, self._text, self._task = column, heads, text_column, task_column

    def __call__(self, row):
        if not isinstance(row, dict):
            return row
        out = {**row, GOLD_KEY: row.get(self._column)}
        if self._heads:
            head = self._heads.get(None if self._task is None else row.get(self._task))
            out[FIT_KEY] = head is not None and head.trained_on(row.get(self._text))
        return out


def count_rows(pcoll, name: str, *, label: str):
    """Pass `pcoll` through, counting its elements in counter `name`."""
    counter = Metrics.counter(NAMESPACE, name)

    def inc(x):
        counter.inc()
        return x

    return pcoll | label >> beam.Map(inc)


class LabelCounter:
    """Counts labelled rows per label and, with a gold column, right answers and the
    confusion pairs (one counter per (gold, predicted) pair seen). Called from the step
    that emits the final labelled rows, so a row is counted once it is sure to be written."""

    def __init__(self, eval_label_column: str | None):
        self._gold = eval_label_column

    def __call__(self, row: dict) -> None:
        Metrics.counter(NAMESPACE, "labeled").inc()
        Metrics.counter(NAMESPACE, f"label:{row['label']}").inc()
        if self._gold and row.get(FIT_KEY):  # a row the head was fit on: not evidence of accuracy
            Metrics.counter(NAMESPACE, "evaluated_fit_rows").inc()
        elif self._gold:
            gold = row.get(GOLD_KEY)
            gold = "" if gold is None else str(gold)
            Metrics.counter(NAMESPACE, "evaluated").inc()
            Metrics.counter(NAMESPACE, f"pair:{json.dumps([gold, row['label']])}").inc()
            if gold == row["label"]:
                Metrics.counter(NAMESPACE, "correct").inc()


class RowCounter:
    """Counts the rows a step emits as final output (counter `name`), like `LabelCounter`
    for steps without labels."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, row: dict) -> None:
        Metrics.counter(NAMESPACE, self._name).inc()


class CountFailures(beam.DoFn):
    """Counts failed rows per reason."""

    def process(self, record: dict):
        Metrics.counter(NAMESPACE, "failed").inc()
        Metrics.counter(NAMESPACE, f"reason:{record['reason']}").inc()
        yield record


def _reported(metric):
    """A metric's committed value, else its attempted one (some runners report only that)."""
    try:
        value = metric.committed
    except Exception:  # noqa: BLE001 - runners without committed metrics raise their own kind
        value = None
    return value if value is not None else metric.attempted


def _counters(result, namespace: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]:
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(_reported(c) or 0)
    return out


def _distributions(result, namespace: str) -> dict[str, dict[str, int]]:
    """{name: {sum, count, min, max}} of the distributions in `namespace`."""
    out: dict[str, dict[str, int]] = {}
    for d in result.metrics().query(MetricsFilter().with_namespace(namespace))["distributions"]:
        value = _reported(d)
        if value is None or not value.count:
            continue
        seen = out.setdefault(d.key.metric.name, {"sum": 0, "count": 0, "min": value.min, "max": value.max})
        seen["sum"] += value.sum
        seen["count"] += value.count
        seen["min"], seen["max"] = min(seen["min"], value.min), max(seen["max"], value.max)
    return out


def _timing(lib: dict[str, dict[str, int]], labeled: int, step: str = "classification") -> dict:
    """Start-up (slowest worker), classification alone (model time over the rows) and the
    self-check's cached-vs-full ms per row, from the library's distributions."""
    def slowest_s(name):
        return round(lib[name]["max"] / 1e3, 3) if name in lib else None

    out = {"startup": {"model_load_s": slowest_s("startup_model_load_ms"),
                       "prefix_build_s": slowest_s("startup_prefix_build_ms"),
                       "self_check_s": slowest_s("startup_self_check_ms"),
                       "prefix_builds": lib.get("startup_prefix_build_ms", {}).get("count", 0)}}
    model_s = lib.get("batch_latency_micros", {}).get("sum", 0) / 1e6
    out[step] = {"rows": labeled, "model_s": round(model_s, 3),
                             "rows_per_s": round(labeled / model_s, 2) if model_s else None,
                             "ms_per_row": round(1e3 * model_s / labeled, 2) if labeled else None}
    cached, full = lib.get("self_check_cached_us_per_row"), lib.get("self_check_full_us_per_row")
    if cached and full:
        c, f = cached["sum"] / cached["count"] / 1e3, full["sum"] / full["count"] / 1e3
        out["self_check"] = {"cached_ms_per_row": round(c, 2), "full_ms_per_row": round(f, 2),
                             "speedup": round(f / c, 2) if c else None}
    return out


def _tasks(lib: dict[str, int]) -> dict:
    """Routed runs: the prefix pool's builds, hits and evictions, and per task (top 20 by
    rows) its rows and the share of its batches served from the pool."""
    rows = {k.split(":", 1)[1]: v for k, v in lib.items() if k.startswith("task_rows:")}
    if not rows:
        return {}
    per_task = []
    for name, n in sorted(rows.items(), key=lambda kv: (-kv[1], kv[0]))[:20]:
        batches, builds = lib.get(f"task_batches:{name}", 0), lib.get(f"task_builds:{name}", 0)
        per_task.append({"task": name, "rows": n, "batches": batches, "builds": builds,
                         "hit_rate": round(1 - builds / batches, 4) if batches else None})
    builds, hits = lib.get("prefix_builds", 0), lib.get("prefix_hits", 0)
    return {"prefix_pool": {"builds": builds, "hits": hits, "evictions": lib.get("prefix_evictions", 0),
                            "hit_rate": round(hits / (builds + hits), 4) if builds + hits else None},
            "tasks": per_task}


def summarize(result, *, wall_s: float, labels: Sequence[str], outputs: dict[str, str],
              model: str, task: str, eval_label_column: str | None, kind: str = "classify",
              head: str | None = None) -> dict:
    """The summary dict of a finished run (counts, label counts, rates, outputs); `kind`
    ``"extract"`` counts extracted rows (``extracted``) and generated tokens instead of labels."""
    mine = _counters(result, NAMESPACE)
    lib = _counters(result, LIBRARY_NAMESPACE)
    done_key = "extracted" if kind == "extract" else "labeled"
    read, labeled, failed = mine.get("rows_read", 0), mine.get(done_key, 0), mine.get("failed", 0)
    summary = {
        "kind": kind, "task": task, "model": model,
        "rows_read": read, done_key: labeled, "failed": failed,
        "accounted_for": read == labeled + failed,
        "label_counts": {n: mine.get(f"label:{n}", 0) for n in labels},
        "failed_reasons": {k.split(":", 1)[1]: v for k, v in sorted(mine.items()) if k.startswith("reason:")},
        "wall_s": round(wall_s, 3),
        "rows_per_s": round((labeled + failed) / wall_s, 2) if wall_s > 0 else None,
        "prefix_tokens_reused": lib.get("prefix_tokens_reused", 0),
        "suffix_tokens_computed": lib.get("suffix_tokens_computed", 0),
        "label_tokens_computed": lib.get("label_tokens_computed", 0),
        "rows_truncated": lib.get("rows_truncated", 0),
        **({"generated_tokens": lib.get("generated_tokens", 0)} if kind == "extract" else {}),
        **_timing(_distributions(result, LIBRARY_NAMESPACE), labeled,
                  "extraction" if kind == "extract" else "classification"),
        **_tasks(lib),
        "outputs": dict(outputs),
    }
    if eval_label_column:
        evaluated = mine.get("evaluated", 0)
        pairs = {tuple(json.loads(k.split(":", 1)[1])): v for k, v in mine.items() if k.startswith("pair:")}
        summary["evaluation"] = {
            "gold_column": eval_label_column, "rows": evaluated,
            "accuracy": round(mine.get("correct", 0) / evaluated, 4) if evaluated else None,
            "confusion": [[g, p, n] for (g, p), n in sorted(pairs.items())],
        }
        if head is not None:  # the rows the head was fit on are left out of the accuracy
            summary["evaluation"].update(head=head, fit_rows_left_out=mine.get("evaluated_fit_rows", 0))
    if not summary["accounted_for"]:
        _LOGGER.error("rows read (%d) != %s (%d) + failed (%d)", read, done_key, labeled, failed)
    return summary


def format_summary(s: dict) -> str:
    """The summary as the lines printed at the end of a run."""
    width = max([len(n) for n in s["label_counts"]] + [5])
    extract = s.get("kind") == "extract"
    done = f"extracted {s['extracted']}" if extract else f"labelled {s['labeled']}"
    lines = [
        f"rows read {s['rows_read']}: {done} + failed {s['failed']}"
        + ("" if s["accounted_for"] else "  (MISMATCH: some rows are unaccounted for)"),
        *_timing_lines(s),
        f"prefix tokens reused {s['prefix_tokens_reused']:,}; suffix tokens computed "
        f"{s['suffix_tokens_computed']:,}"
        + (f" (of which label tokens {s['label_tokens_computed']:,})" if s.get("label_tokens_computed") else "")
        + (f"; tokens generated {s['generated_tokens']:,}" if extract else ""),
    ]
    if not extract:
        lines.append("labels:")
        lines += [f"  {n:<{width}} {c}" for n, c in sorted(s["label_counts"].items(), key=lambda kv: -kv[1]) if c]
    pool = s.get("prefix_pool")
    if pool:
        rate = "n/a" if pool["hit_rate"] is None else f"{pool['hit_rate']:.1%}"
        lines.append(f"prefix pool: {pool['builds']} builds, {pool['hits']} hits ({rate} of batches), "
                     f"{pool['evictions']} evictions")
        lines.append("tasks (top 20 by rows):")
        width = max(len(t["task"]) for t in s["tasks"])
        lines += [f"  {t['task']:<{width}} {t['rows']} rows, {t['batches']} batches, hit rate "
                  + ("n/a" if t["hit_rate"] is None else f"{t['hit_rate']:.0%}") for t in s["tasks"]]
    if s["failed_reasons"]:
        lines.append("failed: " + ", ".join(f"{k} {v}" for k, v in s["failed_reasons"].items()))
    if s["rows_truncated"]:
        lines.append(f"truncated to the token budget: {s['rows_truncated']} rows")
    ev = s.get("evaluation")
    if ev:
        acc = "n/a" if ev["accuracy"] is None else f"{ev['accuracy']:.1%}"
        held = ""
        if "head" in ev:
            left = ev["fit_rows_left_out"]
            held = (f" that did not fit the head ({left} rows that fit it left out)" if left else
                    " (held-out: none of them fit the head)")
        lines.append(f"accuracy against '{ev['gold_column']}': {acc} on {ev['rows']} labelled rows{held}")
    lines.append("outputs:")
    lines += [f"  {k}: {v}" for k, v in s["outputs"].items()]
    return "\n".join(lines)


def _timing_lines(s: dict) -> list[str]:
    lines = []
    up = s.get("startup") or {}
    parts = [(name, up.get(key)) for name, key in (("model load", "model_load_s"), ("prefix cache", "prefix_build_s"),
                                                   ("self-check", "self_check_s"))]
    parts = [(name, v) for name, v in parts if v is not None]
    if parts:
        slowest = " (slowest worker)" if up.get("prefix_builds", 0) > 1 else ""
        lines.append(f"start-up {sum(v for _, v in parts):.1f} s{slowest}: "
                     + ", ".join(f"{name} {v:.1f} s" for name, v in parts))
    step = "extraction" if s.get("kind") == "extract" else "classification"
    c = s.get(step) or {}
    if c.get("rows_per_s"):
        lines.append(f"{step}: {c['rows']} rows in {c['model_s']:.1f} s of model time, "
                     f"{c['rows_per_s']} rows/s, {c['ms_per_row']} ms/row")
    check = s.get("self_check")
    if check and check.get("speedup"):
        lines.append(f"self-check: cached {check['cached_ms_per_row']:.1f} ms/row vs full re-encoding "
                     f"{check['full_ms_per_row']:.1f} ms/row ({check['speedup']:.1f}x)")
    lines.append(f"wall {s['wall_s']:.1f} s, {s['rows_per_s']} rows/s end to end (start-up included)")
    return lines


def write_confusion_png(summary: dict, labels: Sequence[str], path: str) -> None:
    """Draw the confusion matrix (rows: gold, columns: predicted) to `path` (any Beam filesystem)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    confusion = summary["evaluation"]["confusion"]
    gold_only = sorted({g for g, _, _ in confusion} - set(labels))
    names = list(labels) + gold_only
    index = {n: i for i, n in enumerate(names)}
    matrix = np.zeros((len(names), len(names)), dtype=np.int64)
    for gold, pred, n in confusion:
        matrix[index[gold], index[pred]] += n
    size = max(5.0, 0.16 * len(names) + 3)
    fig, ax = plt.subplots(figsize=(size, size), dpi=100)
    ax.imshow(matrix, cmap="Blues", interpolation="nearest")
    fontsize = max(4, min(10, int(400 / max(len(names), 1))))
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=fontsize)
    ax.set_yticks(range(len(names)), names, fontsize=fontsize)
    ax.set_xlabel("predicted")
    ax.set_ylabel("gold")
    acc = summary["evaluation"]["accuracy"]
    ax.set_title(f"{summary['task']}: accuracy {acc:.1%} on {summary['evaluation']['rows']} rows"
                 if acc is not None else summary["task"])
    if len(names) <= 20:
        for i in range(len(names)):
            for j in range(len(names)):
                if matrix[i, j]:
                    ax.text(j, i, str(matrix[i, j]), ha="center", va="center", fontsize=fontsize,
                            color="white" if matrix[i, j] > matrix.max() / 2 else "black")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    with FileSystems.create(path) as f:
        f.write(buffer.getvalue())


def write_json(summary: dict, path: str) -> None:
    with FileSystems.create(path) as f:
        f.write((json.dumps(summary, indent=2, default=str) + "\n").encode("utf-8"))
