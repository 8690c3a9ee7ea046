"""ClassifyText on DirectRunner against the bare `PrefixClassifier.classify` loop.

    python -m benchmarks.beam_overhead [--rows 600] [--model embedded]

One process, one model load (the pipeline reuses it through the shared handle, so model
loading is excluded), the same rows for both, each timed after a warm-up. Writes
`benchmarks/results/beam_overhead.json` and prints the throughput ratio.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix import TaskSpec
from beam_prefix.dofn import _MODEL_HANDLE, ClassifyConfig, _ModelHolder
from beam_prefix.transforms import ClassifyText

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = os.path.join(_ROOT, "pipelines", "tasks", "support_tickets.yaml")
TICKETS = os.path.join(_ROOT, "pipelines", "data", "sample_tickets.csv")


def _rows(n: int) -> list[dict]:
    with open(TICKETS, newline="", encoding="utf-8") as f:
        base = list(csv.DictReader(f))
    return [{**base[i % len(base)], "ticket_id": f"R{i:05d}"} for i in range(n)]


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results", "beam_overhead.json"))
    args = parser.parse_args(argv)

    task = TaskSpec.from_yaml(TASK)
    rows = _rows(args.rows)
    transform = ClassifyText(task=task, model=args.model, batch_size=args.batch_size, max_batch_size=64)
    config: ClassifyConfig = transform.config
    holder = _MODEL_HANDLE.acquire(lambda: _ModelHolder(config), tag=config.model_tag)  # load once
    clf = holder.classifier_for(config)
    texts = [r["text"] for r in rows]

    clf.classify(texts[:32])  # warm-up
    start = time.perf_counter()
    clf.classify(texts)
    bare_s = time.perf_counter() - start

    def pipeline():
        p = beam.Pipeline(options=PipelineOptions([]))
        counted = (p | beam.Create(rows) | transform).labeled | beam.combiners.Count.Globally()
        counted | beam.Map(lambda n: None)
        start = time.perf_counter()
        p.run().wait_until_finish()
        return time.perf_counter() - start

    pipeline()  # warm-up: the first run also builds nothing new (shared model and prefix)
    beam_s = pipeline()
    result = {
        "rows": len(rows), "model": clf.model_id, "batch_size": args.batch_size,
        "bare_classify_rows_per_s": len(rows) / bare_s, "classify_text_rows_per_s": len(rows) / beam_s,
        "ratio": bare_s / beam_s, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model_loads": _ModelHolder.loads,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"bare classify: {result['bare_classify_rows_per_s']:.1f} rows/s; ClassifyText on DirectRunner: "
          f"{result['classify_text_rows_per_s']:.1f} rows/s; ratio {result['ratio']:.2f} "
          f"({len(rows)} rows, batch {args.batch_size}, {result['machine']})")
    return result


if __name__ == "__main__":
    run()
