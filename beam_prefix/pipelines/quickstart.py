"""Quick start: classify the shipped sample support tickets with the embedded model.

    python -m beam_prefix.pipelines.quickstart [--task PATH] [--model embedded] [--calibration]

Prints each ticket's label, the accuracy against the sample's gold labels (with and
without contextual calibration), and the per-text time of the prefix-cached path
against full re-encoding of every prompt. The Beam pipeline version of this job is
`pipelines.classify` (see docs/getting-started.md).
"""

from __future__ import annotations

import argparse
import csv
import logging
import time

from beam_prefix import PrefixClassifier, TaskSpec
from beam_prefix.tasks.shipped import shipped_data_path

DEFAULT_TASK = "support_tickets"
SAMPLE_TICKETS = shipped_data_path("sample_tickets.csv")


def _accuracy(preds, gold) -> float:
    return sum(p.label == g for p, g in zip(preds, gold)) / len(gold)


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default=DEFAULT_TASK, help="task YAML file or shipped task name")
    parser.add_argument("--model", default=None, help="'embedded' (default), a directory, a .gguf or a hub id")
    parser.add_argument("--input", default=SAMPLE_TICKETS, help="CSV with text and label columns")
    parser.add_argument("--timing_rows", type=int, default=20, help="rows timed on the full re-encoding path")
    args = parser.parse_args(argv)

    with open(args.input, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    texts, gold = [r["text"] for r in rows], [r.get("label") for r in rows]
    task = TaskSpec.from_yaml(args.task)

    clf = PrefixClassifier.load(task.replace(calibration=False), model=args.model)
    print(f"model {clf.model_id}; prefix of {clf.prefix_length} tokens cached; {clf.mode} scoring; "
          f"prompt fingerprint {clf.fingerprint}")
    start = time.perf_counter()
    preds = clf.classify(texts)
    cached_s = (time.perf_counter() - start) / len(texts)
    calibrated = PrefixClassifier.load(task.replace(calibration=True), model=args.model, verify=False)
    cal_preds = calibrated.classify(texts)

    print(f"\n{'ticket':<70} {'label':<10} {'p':>5} {'calibrated':<10} {'gold':<10}")
    for text, p, c, g in zip(texts, preds, cal_preds, gold):
        print(f"{text[:68]:<70} {p.label:<10} {p.score:5.2f} {c.label:<10} {g or '':<10}")

    n = min(args.timing_rows, len(texts))
    start = time.perf_counter()
    clf.classify_full(texts[:n])
    full_s = (time.perf_counter() - start) / n
    summary = {"rows": len(texts), "cached_ms_per_text": cached_s * 1e3, "full_ms_per_text": full_s * 1e3,
               "speedup": full_s / cached_s}
    if all(gold):
        summary["accuracy"] = _accuracy(preds, gold)
        summary["accuracy_calibrated"] = _accuracy(cal_preds, gold)
        print(f"\naccuracy on {len(texts)} labelled tickets: {summary['accuracy']:.1%} "
              f"(with contextual calibration: {summary['accuracy_calibrated']:.1%})")
    print(f"prefix-cached classify: {summary['cached_ms_per_text']:.1f} ms/text; full re-encoding: "
          f"{summary['full_ms_per_text']:.1f} ms/text ({summary['speedup']:.1f}x)")
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run()
