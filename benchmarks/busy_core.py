"""What a busy core costs, by torch thread setting (#34.8).

    python -m benchmarks.busy_core [--rounds 2] [--out benchmarks/results] [--wait_policies]

A Beam worker's cores are never the engine's alone: the harness's own threads read,
decode and encode rows, and other steps or processes run beside it. torch's CPU threads
meet at a barrier after every parallel op; under OpenMP's default wait policy a thread
that arrives first *spins*, so on a core shared with another busy process the spinning
thread takes the CPU the late one needs. This compares, on the support task (the embedded
model, 60 sample tickets):

contenders (each a long-lived process):
  ``all cores``: torch's default thread count (what a step without ``threads`` ran with
    before this benchmark);
  ``1 thread``;
  ``auto``: what a step without ``threads`` does now (`beam_prefix.beam.thread_choice`):
    each batch's count picked by timing, between all cores and one thread.
  ``--wait_policies`` adds two OpenMP settings instead of ``auto`` (each in its own process,
  since OpenMP reads its environment once, when torch loads it): ``all cores, passive``
  (``OMP_WAIT_POLICY=PASSIVE``: waiting threads sleep at once) and ``all cores, short spin``
  (``GOMP_SPINCOUNT=10000``: spin briefly, then sleep; the default spins 300,000 times).
conditions: ``quiet``; ``busy``: one other process spinning at normal priority;
  ``2 bundles``: two calls at once from two threads of the contender's process (as two
  Beam harness threads running bundles of the same step), quiet otherwise.
workloads: batch 16 (32 rows, 2 calls) and batch 1 (8 rows one by one).

Every round runs each contender once per condition and workload, contenders interleaved,
each measurement after the same untimed run of the workload in that condition (what
``auto`` measures before it settles); the table keeps each contender's best round (ms/row
of wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

CONTENDERS = {
    "all cores": {"threads": 0, "env": {}},
    "1 thread": {"threads": 1, "env": {}},
    "auto": {"threads": -1, "env": {}},
}
WAIT_POLICIES = {
    "all cores": {"threads": 0, "env": {}},
    "1 thread": {"threads": 1, "env": {}},
    "all cores, passive": {"threads": 0, "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
    "all cores, short spin": {"threads": 0, "env": {"GOMP_SPINCOUNT": "10000"}},
}
WARM = 1
CONDITIONS = ("quiet", "busy", "2 bundles")
WORKLOADS = {"batch 16": (16, 32), "batch 1": (1, 8)}


def _serve(threads: int) -> None:
    """Contender process: load once, then answer each ``condition workload`` line on stdin
    with its ms/row. `threads`: 0 torch's default, -1 chosen per batch (`ThreadChoice`)."""
    import torch

    from beam_prefix import PrefixClassifier, TaskSpec
    from beam_prefix.beam.thread_choice import ThreadChoice
    from beam_prefix.model.loading import load_model
    from benchmarks.data import sample_tickets

    choice = ThreadChoice(torch.get_num_threads()) if threads < 0 else None
    if threads > 0:
        torch.set_num_threads(threads)
    loaded = load_model("embedded")
    task = TaskSpec.from_yaml(os.path.join("pipelines", "tasks", "support_tickets.yaml"))
    texts = sample_tickets(32)
    clfs = {b: PrefixClassifier(task=task, loaded=loaded, batch_size=b, verify=False) for b, _ in WORKLOADS.values()}
    for clf in clfs.values():
        clf.classify(texts[:8])  # warm
    print(json.dumps({"ready": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        condition, workload = json.loads(line)
        batch, rows = WORKLOADS[workload]
        clf = clfs[batch]

        def call(c=clf):
            for i in range(0, rows, batch):
                chunk = texts[i:i + batch][: rows - i]
                if choice is None:
                    c.classify(chunk)
                    continue
                n = choice.pick()  # as PrefixStepDoFn does for a step without `threads`
                torch.set_num_threads(n)
                tokens = sum(len(c.encode(t).suffix_ids) for t in chunk)
                t0 = time.perf_counter()
                c.classify(chunk)
                choice.record(n, time.perf_counter() - t0, tokens)

        def once():
            if condition != "2 bundles":
                call()
                return rows
            workers = [threading.Thread(target=call, args=(clf.fork(),)) for _ in range(2)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            return 2 * rows

        for _ in range(WARM):
            once()
        start = time.perf_counter()
        done = once()
        print(json.dumps({"ms_per_row": 1e3 * (time.perf_counter() - start) / done}), flush=True)


def _start(name: str, spec: dict) -> subprocess.Popen:
    env = {k: v for k, v in {**os.environ, **spec["env"]}.items() if v is not None}  # None: unset
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.busy_core", "--serve", str(spec["threads"])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    ready = json.loads(proc.stdout.readline())
    print(f"{name}: ready with {ready['ready']} torch threads", flush=True)
    return proc


def _ask(proc: subprocess.Popen, condition: str, workload: str) -> float:
    proc.stdin.write(json.dumps([condition, workload]) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["ms_per_row"]


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--wait_policies", action="store_true",
                        help="compare OpenMP wait policies instead of the thread choice (busy_core_wait_policies.*)")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        _serve(args.serve)
        return {}
    contenders = WAIT_POLICIES if args.wait_policies else CONTENDERS
    procs = {name: _start(name, spec) for name, spec in contenders.items()}
    best: dict = {}
    try:
        for r in range(args.rounds):
            for condition in CONDITIONS:
                busy = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        if condition == "busy" else None)
                try:
                    for workload in WORKLOADS:
                        for name, proc in procs.items():  # contenders interleaved within the round
                            ms = _ask(proc, condition, workload)
                            key = (condition, workload, name)
                            best[key] = min(best.get(key, float("inf")), ms)
                            print(f"round {r + 1} {condition:9s} {workload:8s} {name:20s} {ms:7.1f} ms/row", flush=True)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    report = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "rounds": args.rounds,
              "contenders": {n: s["env"] or s["threads"] for n, s in contenders.items()},
              "ms_per_row": [{"condition": c, "workload": w, "contender": n, "best": round(v, 2)}
                             for (c, w, n), v in best.items()]}
    os.makedirs(args.out, exist_ok=True)
    name = "busy_core_wait_policies" if args.wait_policies else "busy_core"
    with open(os.path.join(args.out, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out, f"{name}.md"), "w", encoding="utf-8") as f:
        f.write(_markdown(report, best, list(contenders)))
    print(_markdown(report, best, list(contenders)))
    return report


def _markdown(report: dict, best: dict, names: list[str]) -> str:
    lines = [f"# A busy core, by torch thread setting ({report['date']}, {report['cores']} cores, "
             f"best of {report['rounds']} interleaved rounds, ms/row)", "",
             "| condition | workload | " + " | ".join(names) + " |",
             "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for c in CONDITIONS:
        for w in WORKLOADS:
            lines.append(f"| {c} | {w} | " + " | ".join(f"{best[(c, w, n)]:.1f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run()
