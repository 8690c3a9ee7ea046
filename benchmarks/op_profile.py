"""Where our engine's time goes: torch's per-op self time over one `classify` pass.

    python -m benchmarks.op_profile --batch 64 --rows 256     # prints the table

Used by `benchmarks.peers --profile` (in its own worker process, at batch 64 and 1).
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from benchmarks.data import TASKS, sample_tickets


def profile_classify(loaded, task, texts: Sequence[str], batch: int, *, top: int = 25) -> dict:
    """Self CPU time per op (ms per row, share of the pass) of `classify(texts)` at `batch`,
    after one warm-up batch; the profiler's own overhead inflates the total a little."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from beam_prefix import PrefixClassifier

    clf = PrefixClassifier(task=task, loaded=loaded, verify=False, batch_size=batch)
    clf.classify(list(texts[:batch]))
    start = time.perf_counter()
    clf.classify(list(texts))
    plain_ms = 1e3 * (time.perf_counter() - start) / len(texts)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        clf.classify(list(texts))
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"op": e.key, "calls_per_row": e.count / len(texts),
             "self_ms_per_row": e.self_cpu_time_total / 1e3 / len(texts),
             "share": e.self_cpu_time_total / total} for e in events[:top]]
    return {"batch": batch, "rows": len(texts), "ms_per_row_unprofiled": plain_ms,
            "profiled_ms_per_row": total / 1e3 / len(texts), "torch_threads": torch.get_num_threads(), "ops": rows}


def markdown(result: dict) -> str:
    lines = [f"batch {result['batch']}, {result['rows']} rows: {result['ms_per_row_unprofiled']:.2f} ms/row "
             f"unprofiled, {result['profiled_ms_per_row']:.2f} ms/row of op self time under the profiler",
             "", "| op | calls/row | self ms/row | share |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r['op']}` | {r['calls_per_row']:.2f} | {r['self_ms_per_row']:.3f} | {100 * r['share']:.1f}% |"
              for r in result["ops"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    from beam_prefix import TaskSpec
    from beam_prefix.model.loading import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--task", default=os.path.join(TASKS, "support_tickets.yaml"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    texts = sample_tickets(args.rows)
    loaded = load_model(args.model, threads=args.threads)
    print(markdown(profile_classify(loaded, TaskSpec.from_yaml(args.task), texts, args.batch, top=args.top)))


if __name__ == "__main__":
    main()
