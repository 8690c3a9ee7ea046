"""Routing benchmark: many tasks in one step against one step per task.

    python -m benchmarks.routing [--tasks 20 --rows 1000 --rounds 2 --capped_tasks 5]

`--tasks` prompts (the support task's labels or a four-label triage set, each with its own
instructions, so each has its own ~280-token prefix), `--rows` sample tickets in random task
order. Contenders, each a DirectRunner pipeline in its own process (so its peak RSS is its
own), timed in interleaved rounds, best round of each:

- **routed**: one `ClassifyText(tasks=..., task_column=...)` step;
- **per task**: one single-task `ClassifyText` step per task, each fed its own rows;
- **routed, capped**: routed with `max_prefix_cache_mb` holding only `--capped_tasks`
  prefixes, so tasks are evicted and rebuilt (the rebuild count is reported).

Every contender first loads the model once outside the timing (the same warm-up for all);
its wall time then includes the pipeline's own model load and its prefix builds. Labels
are compared with the per-task run's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

from benchmarks.data import DATA, ROOT, TASKS, RESULTS

__all__ = ["run"]

_LOGGER = logging.getLogger(__name__)
_TRIAGE = ("urgent", "normal", "spam", "question")
_TOPICS = ("a bank", "a game studio", "an airline", "a school", "a hospital", "a shop", "a telecom",
           "a hotel chain", "a car dealer", "a gym", "a newspaper", "a city council", "an insurer",
           "a utility", "a cinema", "a bakery", "a law firm", "a courier", "a museum", "a cloud host")


def _tasks(n: int) -> dict:
    from beam_prefix.tasks.task import TaskSpec

    base = TaskSpec.from_yaml(os.path.join(TASKS, "support_tickets.yaml"))
    out = {}
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        spec = base.replace(name=f"tenant{i:02d}", instructions=f"You route messages sent to {topic} (desk {i}). "
                                                               + base.instructions)
        if i % 2:
            spec = spec.replace(labels=_TRIAGE, examples=(), calibration=False)
        out[f"tenant{i:02d}"] = spec
    return out


def _rows(n: int, keys: list[str]) -> list[dict]:
    import pyarrow.parquet as pq

    texts = [r["text"] for r in pq.read_table(os.path.join(DATA, "sample_tickets.parquet")).to_pylist()]
    rng = random.Random(0)
    return [{"id": i, "tenant": rng.choice(keys), "text": texts[i % len(texts)]} for i in range(n)]


def _one(contender: str, args) -> dict:
    """Run one contender in this process; return its labels, wall time and counters."""
    import apache_beam as beam
    from apache_beam.metrics.metric import MetricsFilter
    from apache_beam.options.pipeline_options import PipelineOptions

    from beam_prefix.beam.classify_transform import ClassifyText

    from beam_prefix import PrefixClassifier
    from beam_prefix.model.loading import load_model

    tasks = _tasks(args.tasks)
    rows = _rows(args.rows, sorted(tasks))
    # the same warm-up in every contender (files and torch warm; the pipeline loads its own
    # copy), which also measures one prefix for the capped pool's bound
    sample = PrefixClassifier(task=next(iter(tasks.values())), loaded=load_model(args.model), verify=False)
    out = tempfile.mkdtemp(prefix="routing-bench-")
    common = dict(model=args.model, verify=False, batch_size=16, id_column="id", keep_columns=["id"])
    p = beam.Pipeline(options=PipelineOptions(["--direct_running_mode=in_memory"]))
    source = p | beam.Create(rows, reshuffle=False)
    if contender == "per_task":
        labeled = [source | f"Rows{k}" >> beam.Filter(lambda r, k=k: r["tenant"] == k)
                   | f"Classify{k}" >> ClassifyText(task=spec, **common) for k, spec in sorted(tasks.items())]
        labeled = [r.labeled for r in labeled] | beam.Flatten()
    else:
        cap = None
        if contender == "capped":
            cap = (args.capped_tasks + 0.5) * sample.prefix_cache.nbytes / 2**20
        labeled = (source | ClassifyText(tasks=tasks, task_column="tenant", max_prefix_cache_mb=cap,
                                         **common)).labeled
    _ = (labeled | beam.Map(lambda r: json.dumps([r["id"], r["label"]]))
         | beam.io.WriteToText(os.path.join(out, "labels"), shard_name_template=""))
    start = time.perf_counter()
    result = p.run()
    result.wait_until_finish()
    wall = time.perf_counter() - start
    counters = {c.key.metric.name: c.committed for c in
                result.metrics().query(MetricsFilter().with_namespace("beam_prefix"))["counters"]}
    with open(os.path.join(out, "labels"), encoding="utf-8") as f:
        labels = dict(json.loads(line) for line in f)
    return {"contender": contender, "wall_s": wall, "rows_per_s": len(rows) / wall, "labels": labels,
            "prefix_builds": counters.get("prefix_builds"), "prefix_evictions": counters.get("prefix_evictions", 0),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run(argv=None) -> dict:
    args = _parser().parse_args(argv)
    runs: dict[str, list[dict]] = {"routed": [], "per_task": [], "capped": []}
    for r in range(args.rounds):
        for contender in runs:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, "-m", "benchmarks.routing", "--one", contender, "--json", f.name,
                                *_forward(args)], check=True, cwd=ROOT)
                runs[contender].append(json.load(open(f.name, encoding="utf-8")))
            _LOGGER.info("round %d %s: %.1f rows/s", r + 1, contender, runs[contender][-1]["rows_per_s"])
    best = {k: max(v, key=lambda x: x["rows_per_s"]) for k, v in runs.items()}
    reference = best["per_task"]["labels"]
    report = {"tasks": args.tasks, "rows": args.rows, "rounds": args.rounds, "capped_tasks": args.capped_tasks,
              "contenders": {k: {key: val for key, val in b.items() if key != "labels"}
                             | {"agreement": sum(b["labels"].get(i) == lab for i, lab in reference.items())
                                / len(reference),
                                "rows_per_s_rounds": [x["rows_per_s"] for x in runs[k]]}
                             for k, b in best.items()},
              "routed_over_per_task": best["routed"]["rows_per_s"] / best["per_task"]["rows_per_s"],
              "capped_over_per_task": best["capped"]["rows_per_s"] / best["per_task"]["rows_per_s"]}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "routing.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return report


def _forward(args) -> list[str]:
    return [f"--tasks={args.tasks}", f"--rows={args.rows}", f"--capped_tasks={args.capped_tasks}",
            f"--model={args.model}"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--capped_tasks", type=int, default=5)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out_dir", default=RESULTS)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cli = _parser().parse_args()
    if cli.one:
        with open(cli.json, "w", encoding="utf-8") as f:
            json.dump(_one(cli.one, cli), f)
    else:
        run()
