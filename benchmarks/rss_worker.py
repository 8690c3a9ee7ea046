"""One worker process running ClassifyText on DirectRunner with N threads; prints its peak RSS.

    python -m benchmarks.rss_worker --threads 4 --rows 200 [--model embedded]

Run by `benchmarks.speedup` once with 1 thread and once with 4, each in a fresh process,
to show that the threads share one copy of the weights.
"""

from __future__ import annotations

import argparse
import json
import resource

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix.beam.classify_transform import ClassifyText
from beam_prefix.pipelines.options import SAMPLE_TICKETS


def _peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not getrusage: ru_maxrss survives exec, so a child
    of a large process would report its parent's peak."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--model", default="embedded")
    args = parser.parse_args(argv)

    import pyarrow.parquet as pq

    base = pq.read_table(SAMPLE_TICKETS).to_pylist()
    rows = [{**base[i % len(base)], "ticket_id": f"R{i}"} for i in range(args.rows)]
    options = PipelineOptions(["--direct_running_mode=multi_threading", f"--direct_num_workers={args.threads}"])
    with beam.Pipeline(options=options) as p:
        _ = (p | beam.Create(rows) | beam.Reshuffle()
             | ClassifyText(task="support_tickets", model=args.model, max_batch_size=16,
                            threads=1, verify=False)).labeled | beam.combiners.Count.Globally()
    result = {"threads": args.threads, "rows": args.rows, "max_rss_mb": _peak_rss_mb()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
