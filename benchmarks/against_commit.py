"""Is the CPU path slower than it was at an earlier commit? This tree against `--base`, timed together.

    python -m benchmarks.against_commit --base c6dbd2a [--rounds 8] [--rows 256] [--one_row_rows 60]
        [--extract_rows 64]

Benchmarks run on different days differ by the machine more than by the code (two runs a
day apart on these shared cores moved full re-encoding by 12%; the CPU model itself may
change between sessions), so comparing today's ms/row with a number in the docs says
little. This times both versions of the engine in one run: the base commit's tree
(`git archive`, into a temporary folder) and this working tree each load the same model and
task in a worker process of their own (`benchmarks/commit_worker.py`, run by path inside
each tree), and the driver asks them in turn, one at a time, to classify the same rows
(`PrefixClassifier.classify` at `--batch` and one row at a time), alternating which goes first
each round, after one untimed warm-up round each; and, with `--extract_task`, the same
for `Extractor.extract` (constrained decoding) at `--batch`. Reported per kind of call: each
side's best and median round, the median of the per-round ratios (this tree's ms/row over
the base's; above 1, this tree is slower), and whether both gave the same answers (labels,
generated text) on every row.

Writes `<name>.json` and `<name>.md` under `--out_dir`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.data import ROOT, RESULTS, TASKS, sample_tickets, write_results
from benchmarks.peers import Worker, _machine

WORKER = os.path.join(ROOT, "benchmarks", "commit_worker.py")


def checkout(base: str, into: str) -> str:
    """The tree of commit `base` of this repository, unpacked under `into`; its full hash."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}"], cwd=ROOT,
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--base {base!r} is not a commit of the repository at {ROOT}")
    commit = found.stdout.strip()
    archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", into], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {commit} failed")
    return commit


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare with (any git revision)")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--task", default=os.path.join(TASKS, "support_tickets.yaml"),
                        help="a task file (read from this tree by both sides)")
    parser.add_argument("--rows", type=int, default=256, help="rows per round at --batch")
    parser.add_argument("--one_row_rows", type=int, default=60, help="rows per round one at a time (0: skip)")
    parser.add_argument("--extract_task", default=os.path.join(TASKS, "ticket_fields.yaml"),
                        help="an extraction task file, timed too ('' to skip)")
    parser.add_argument("--extract_rows", type=int, default=64, help="rows per round extracted at --batch")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out_dir", default=RESULTS)
    parser.add_argument("--name", default="against_commit")
    args = parser.parse_args(argv)
    extract = bool(args.extract_task and args.extract_rows)
    settings = {"model": args.model, "task": os.path.abspath(args.task), "threads": args.threads, "batch": args.batch,
                "extract_task": os.path.abspath(args.extract_task) if extract else None}
    classes = {f"batch {args.batch}": ("classify", args.batch, sample_tickets(args.rows))}
    if args.one_row_rows:
        classes["batch 1"] = ("classify", 1, sample_tickets(args.one_row_rows))
    if extract:
        classes[f"extraction, batch {args.batch}"] = ("extract", args.batch, sample_tickets(args.extract_rows))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        commit = checkout(args.base, tmp)
        workers = {"base": Worker(args.threads, command=(WORKER,), tree=tmp),
                   "this tree": Worker(args.threads, command=(WORKER,), tree=ROOT)}
        try:
            for worker in workers.values():
                worker.ask(op="load", **settings)
            times = {side: {c: [] for c in classes} for side in workers}
            answers: dict = {}
            for r in range(args.rounds + 1):  # round 0 warms up, untimed
                for c, (kind, batch, texts) in classes.items():
                    for side in (["base", "this tree"] if r % 2 else ["this tree", "base"]):
                        got = workers[side].ask(op="time", kind=kind, texts=texts, batch=batch)
                        answers[(side, c)] = got["answers"]
                        if r:
                            times[side][c].append(got["ms_per_row"])
                if r:
                    print(f"round {r}: " + ", ".join(f"{s} {c} {t[c][-1]:.1f}" for s, t in times.items()
                                                      for c in classes), file=sys.stderr)
        finally:
            for w in workers.values():
                w.close()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(), "threads": args.threads,
              "model": args.model, "task": os.path.basename(args.task), "rounds": args.rounds,
              "extract_task": os.path.basename(args.extract_task) if extract else None,
              "base": commit, "this_tree": head + (" with uncommitted changes" if dirty else ""), "classes": {}}
    for c, (_, _, texts) in classes.items():
        base, this = times["base"][c], times["this tree"][c]
        report["classes"][c] = {
            "rows": len(texts), "base_rounds": base, "this_tree_rounds": this,
            "base_best": min(base), "this_tree_best": min(this),
            "base_median": statistics.median(base), "this_tree_median": statistics.median(this),
            "median_ratio": statistics.median(t / b for t, b in zip(this, base)),
            "same_answers": answers[("base", c)] == answers[("this tree", c)]}
    write_results(args.out_dir, args.name, report, _markdown(report), indent=2)
    print(_markdown(report))
    return report


def _markdown(r: dict) -> str:
    tasks = f"task `{r['task']}`" + (f", extraction task `{r['extract_task']}`" if r.get("extract_task") else "")
    lines = [f"# This tree against commit {r['base'][:10]} ({r['date']}, {r['machine']}, {r['threads']} threads)", "",
             f"{r['model']}, {tasks}; this tree: {r['this_tree'][:10]}{r['this_tree'][40:]}; "
             f"{r['rounds']} interleaved rounds after a warm-up, one run. Ratio: this tree's ms/row over the "
             "base's, the median of the rounds' ratios (above 1: this tree is slower).", "",
             "| rows | base best / median ms/row | this tree best / median ms/row | ratio | same answers |",
             "| --- | --- | --- | --- | --- |"]
    for c, v in r["classes"].items():
        lines.append(f"| {c}, {v['rows']} rows | {v['base_best']:.1f} / {v['base_median']:.1f} | "
                     f"{v['this_tree_best']:.1f} / {v['this_tree_median']:.1f} | {v['median_ratio']:.3f} | "
                     f"{'yes' if v['same_answers'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run()
