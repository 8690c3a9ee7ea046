"""The engine on a GPU: rows/s, how busy the device is, launches and host syncs per batch (#36).

    python -m benchmarks.gpu [--device cuda] [--batch_sizes 64,256,1024,4096] [--out_dir DIR]

Skipped with a line where CUDA is absent (`--device cpu` runs the harness itself, as the
tests do on a tiny model; its figures say nothing about a GPU). Per workload (the
support head, LM label scoring of the support task, extraction of the ticket fields; the
held-out tickets repeated to `--rows`):

- rows/s per batch size, best of `--rounds` (device synchronised around each call), for
  classification once per `--suffix_passes` (packed, fixed-shape buckets, CUDA graphs of
  those buckets: `beam_prefix.model.suffix_graphs`; graphs are recorded in the warm-up call);
- one profiled call at the middle batch size: wall time, device busy time (the kernels'
  own device time; its share of the wall), kernel launches and host synchronisations
  (``aten::item``/``_local_scalar_dense``/``nonzero`` and CUDA stream/device syncs), per batch;
- per classification workload, exactness on the 66 held-out tickets: the largest score
  difference from full re-encoding (`--exact_rows` of them), and for buckets and graphs the
  labels equal to the packed pass's and the largest score difference from it;
- per classification workload, `--batch_one_rows` rows classified one at a time against
  the same rows' whole prompts re-encoded one at a time (ms/row);
- the bound: a plain forward of ``[B, 20]`` tokens through the base model (what the
  device does with no engine around it), rows/s at the same batch sizes.

Writes ``gpu.json`` and ``gpu.md`` (date, device name, torch version) under `--out_dir`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time

import torch

from benchmarks.data import DATA, RESULTS, TASKS

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best(call, device: str, rounds: int) -> float:
    call()  # warm
    times = []
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _profiled(call, device: str, batches: int) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    call()
    _sync(device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        call()
        _sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    busy_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    syncs = sum(e.count for e in events if e.key in SYNC_OPS)
    return {"wall_ms": round(1e3 * wall, 1), "device_busy_ms": round(busy_us / 1e3, 1),
            "device_busy_share": round(busy_us / 1e6 / wall, 3), "batches": batches,
            "launches_per_batch": round(launches / batches, 1), "host_syncs_per_batch": round(syncs / batches, 1)}


def _exactness(engine, texts, packed, full_rows: int) -> tuple[dict, list]:
    """The held-out tickets: the largest score difference from full re-encoding (first
    `full_rows`), and, given the packed pass's answers, label agreement and the largest
    score difference from them; and the engine's answers."""
    answers = engine.classify(texts)
    diff = lambda xs, ys: max(abs(x.scores[k] - y.scores[k]) for x, y in zip(xs, ys) for k in x.scores)
    out = {"rows": len(texts),
           "max_score_diff_vs_full": diff(answers[:full_rows], engine.classify_full(texts[:full_rows]))}
    if packed is not None:
        out["labels_equal_to_packed"] = sum(a.label == p.label for a, p in zip(answers, packed)) / len(texts)
        out["max_score_diff_vs_packed"] = diff(answers, packed)
    return out, answers


def _bound(model, device: str, batch_sizes, rounds: int) -> dict:
    """A plain forward of [B, 20] tokens through the base model: rows/s."""
    out = {}
    for b in batch_sizes:
        ids = torch.randint(100, 1000, (b, 20), device=device)
        with torch.inference_mode():
            seconds = _best(lambda: model.base_model(input_ids=ids, use_cache=False), device, rounds)
        out[b] = round(b / seconds, 1)
    return out


def run(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--batch_sizes", default="64,256,1024,4096")
    parser.add_argument("--extract_batch_sizes", default="64,256")
    parser.add_argument("--rows", type=int, default=4096, help="rows per call (the held-out tickets repeated)")
    parser.add_argument("--extract_rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="head,lm,extract")
    parser.add_argument("--suffix_passes", default=None,
                        help="how classification runs its batches, each measured as its own workload: packed, "
                             "buckets, graphs (default: packed,buckets,graphs on CUDA, packed,buckets elsewhere; "
                             "extraction always runs packed)")
    parser.add_argument("--batch_one_rows", type=int, default=32,
                        help="rows classified one at a time, per workload, against the same rows' whole prompts "
                             "re-encoded one at a time (0: skip)")
    parser.add_argument("--exact_rows", type=int, default=16,
                        help="held-out tickets checked against full re-encoding per workload")
    parser.add_argument("--out_dir", default=RESULTS)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device here (python -m benchmarks.gpu measures a GPU; --device cpu checks the harness)")
        return None
    from beam_prefix import Extractor, PrefixClassifier
    from beam_prefix.model import load_model

    loaded = load_model(args.model, device=args.device)
    with open(os.path.join(DATA, "heldout_tickets.csv"), newline="", encoding="utf-8") as f:
        tickets = [r["text"] for r in csv.DictReader(f)]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": _device_name(args.device),
              "torch": torch.__version__, "model": args.model, "workloads": {}}
    passes = (args.suffix_passes or ("packed,buckets,graphs" if args.device.startswith("cuda")
                                     else "packed,buckets")).split(",")
    report["suffix_passes"] = passes
    engines = {
        "head": lambda b, sp: PrefixClassifier.load(os.path.join(TASKS, "support_tickets_head.yaml"), args.model,
                                                    device=args.device, batch_size=b, verify=False, suffix_pass=sp),
        "lm": lambda b, sp: PrefixClassifier.load(os.path.join(TASKS, "support_tickets.yaml"), args.model,
                                                  device=args.device, batch_size=b, verify=False, suffix_pass=sp),
        "extract": lambda b, sp: Extractor.load(os.path.join(TASKS, "ticket_fields.yaml"), args.model,
                                                device=args.device, batch_size=b, verify=False),
    }
    runs = [(name, sp) for name in args.workloads.split(",") for sp in (["packed"] if name == "extract" else passes)]
    packed_answers = {}
    for name, suffix_pass in runs:
        extract = name == "extract"
        workload = name
        batch_sizes = [int(b) for b in args.extract_batch_sizes.split(",")] if extract else sizes
        rows = (tickets * (1 + args.rows // len(tickets)))[:args.extract_rows if extract else args.rows]
        engine = engines[name](batch_sizes[0], suffix_pass)
        if suffix_pass != "packed":
            name = f"{name}, {suffix_pass}"
        call = (lambda: engine.extract(rows)) if extract else (lambda: engine.classify(rows))
        result = {"rows": len(rows), "rows_per_s": {}}
        if not extract:  # exact: against full re-encoding, and the same answers as the packed pass
            result["exactness"], answers = _exactness(engine, tickets, packed_answers.get(workload),
                                                      args.exact_rows)
            if suffix_pass == "packed":
                packed_answers[workload] = answers
        for b in batch_sizes:
            engine.batch_size = b
            result["rows_per_s"][b] = round(len(rows) / _best(call, args.device, args.rounds), 1)
        if not extract and args.batch_one_rows:  # a row at a time: where launches weigh most
            few = rows[:args.batch_one_rows]
            engine.batch_size = 1
            cached = _best(lambda: engine.classify(few), args.device, args.rounds)
            full = _best(lambda: engine.classify_full(few), args.device, args.rounds)
            result["batch_one_ms_per_row"] = {"cached": round(1e3 * cached / len(few), 2),
                                              "full_reencoding": round(1e3 * full / len(few), 2)}
        middle = batch_sizes[len(batch_sizes) // 2]
        engine.batch_size = middle
        result["profiled"] = {"batch": middle, **_profiled(call, args.device, -(-len(rows) // middle))}
        report["workloads"][name] = result
        print(name, json.dumps(result), flush=True)
        del engine
    report["bound_plain_forward_rows_per_s"] = _bound(loaded.model, args.device, sizes, args.rounds)
    _write(report, args.out_dir)
    return report


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({os.cpu_count()} cores)"


def _write(report: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    lines = [f"# The engine on {report['device']} ({report['date']}, torch {report['torch']}, {report['model']})", "",
             "| workload | rows/s by batch size | batch 1, ms/row: cached vs full re-encoding | profiled batch "
             "| busy share | launches / batch | host syncs / batch |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, w in report["workloads"].items():
        p = w["profiled"]
        rates = ", ".join(f"{b}: {r:,.0f}" for b, r in w["rows_per_s"].items())
        one = w.get("batch_one_ms_per_row")
        ones = f"{one['cached']} vs {one['full_reencoding']}" if one else "-"
        lines.append(f"| {name} | {rates} | {ones} | {p['batch']} | {p['device_busy_share']:.0%} "
                     f"| {p['launches_per_batch']} | {p['host_syncs_per_batch']} |")
    lines += ["", "Exactness on the held-out tickets (largest score difference):"]
    for name, w in report["workloads"].items():
        e = w.get("exactness")
        if e:
            same = (f"; labels equal to packed's {e['labels_equal_to_packed']:.1%}, largest difference "
                    f"{e['max_score_diff_vs_packed']:.1e}" if "labels_equal_to_packed" in e else "")
            lines.append(f"- {name}: against full re-encoding {e['max_score_diff_vs_full']:.1e}{same}")
    bound = ", ".join(f"{b}: {r:,.0f}" for b, r in report["bound_plain_forward_rows_per_s"].items())
    lines += ["", f"Bound, a plain forward of [B, 20] tokens (rows/s by batch size): {bound}."]
    with open(os.path.join(out_dir, "gpu.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    run()
