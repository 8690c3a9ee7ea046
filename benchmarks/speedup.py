"""Side-by-side speed of beam-prefix against the loops users write otherwise, and the FLOP floor.

    python -m benchmarks.speedup                       # everything, embedded model (long)
    python -m benchmarks.speedup --workloads support --banking77_rows 0 --skip rss,scaling

One process, one model load; the same rows for every contender, each timed after a
warm-up; results are ratios from this one run (absolute times are noisy on shared
machines). Contenders (see `benchmarks.contenders`): A full re-encode, B the cached
one-row recipe, C `PrefixClassifier.classify` at several batch sizes, D `ClassifyText` on
DirectRunner. Every contender's labels are compared with A's. Also: the FLOP floor,
prefix-length scaling (PNG), peak RSS of a worker with 1 and 4 threads, and optional
faster modes (int8 dynamic quantization, bf16), each with its agreement with A.

Writes `speedup.json`, `speedup.md` and `prefix_scaling.png` under `--out_dir`.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import subprocess
import sys
import time

import torch

from beam_prefix import PrefixClassifier, TaskSpec
from beam_prefix.model.cpu_linear import unpack_linears
from beam_prefix.beam.classify_dofn import ClassifyConfig
from beam_prefix.beam.worker import _MODEL_HANDLE, ModelHolder
from beam_prefix.model.loading import LoadedModel, load_model
from beam_prefix.tasks.task import Example
from beam_prefix.beam.classify_transform import ClassifyText
from benchmarks import contenders
from benchmarks import report as report_module
from benchmarks.batch_one import batch_one
from benchmarks.data import ROOT, DATA, TASKS, RESULTS, csv_rows, sample_tickets
from benchmarks.floor import floor_ms_per_row, matmul_gflops, non_embedding_params, other_flops_per_row

_LOGGER = logging.getLogger(__name__)


def _workloads(args) -> dict[str, tuple[TaskSpec, list[str]]]:
    out = {}
    if "support" in args.workloads and args.support_rows:
        out["support"] = (TaskSpec.from_yaml(os.path.join(TASKS, "support_tickets.yaml")),
                          sample_tickets(args.support_rows))
    if "banking77" in args.workloads and args.banking77_rows:
        texts = [t for t, _ in csv_rows(args.banking77_csv, label="category")]
        if len(texts) < args.banking77_rows:
            raise SystemExit(f"{args.banking77_csv} has {len(texts)} rows, fewer than --banking77_rows")
        out["banking77"] = (TaskSpec.from_yaml(os.path.join(TASKS, "banking77.yaml")),
                            texts[:args.banking77_rows])
    return out


def _agreement(labels: list[str], reference: list[str]) -> float:
    n = min(len(labels), len(reference))
    return sum(a == b for a, b in zip(labels[:n], reference[:n])) / n if n else float("nan")


def _a_rows(name: str, args) -> int | None:
    return args.banking77_a_rows if name == "banking77" else args.a_rows


def _bench_workload(name, task, texts, loaded, args) -> tuple[dict, list[str]]:
    """The workload's report entry, and A's labels (the optional modes' reference)."""
    clf = PrefixClassifier(task=task, loaded=loaded, verify=False)
    limit = _a_rows(name, args)
    a_rows = texts[:limit] if limit else texts
    warm = texts[:2]
    result = {"rows": len(texts), "a_rows": len(a_rows), "prefix_tokens": clf.prefix_length,
              "scoring": clf.mode, "label_search": clf.label_search, "label_tokens": clf.label_tokens,
              "contenders": []}

    contenders.full_reencode(clf, warm)
    a_labels, a_ms = contenders.timed(lambda: contenders.full_reencode(clf, a_rows), len(a_rows))
    result["contenders"].append({"name": "A full re-encode", "batch": 1, "ms_per_row": a_ms, "agreement": 1.0})
    _LOGGER.info("%s A: %.1f ms/row", name, a_ms)

    contenders.cached_recipe(clf, warm)
    b_labels, b_ms = contenders.timed(lambda: contenders.cached_recipe(clf, a_rows), len(a_rows))
    result["contenders"].append({"name": "B cached, one row (recipe)", "batch": 1, "ms_per_row": b_ms,
                                 "agreement": _agreement(b_labels, a_labels)})
    _LOGGER.info("%s B: %.1f ms/row", name, b_ms)

    best = None
    c_name = "C PrefixClassifier.classify" + (" (pruned label search)" if clf.label_search == "pruned" else "")
    sizes = args.banking77_batch_sizes if name == "banking77" else args.batch_sizes
    for batch in sizes if len(sizes) > 1 else ():  # one size: the interleaved rounds time it
        contenders.batched(clf, texts[:batch], batch)
        c_labels, c_ms = contenders.timed(lambda: contenders.batched(clf, texts, batch), len(texts))
        entry = {"name": c_name, "batch": batch, "ms_per_row": c_ms, "agreement": _agreement(c_labels, a_labels)}
        result["contenders"].append(entry)
        _LOGGER.info("%s C batch %d: %.1f ms/row", name, batch, c_ms)
        if best is None or c_ms < best["ms_per_row"]:
            best = entry
    if best is None:
        best = {"name": c_name, "batch": sizes[0], "ms_per_row": float("nan"), "agreement": float("nan")}
        result["contenders"].append(best)
    result["best_c"] = best

    # the engine before shared-prefix attention, same batch, on A's rows: what the split buys
    expanded = PrefixClassifier(task=task, loaded=loaded, verify=False, prefix_attention="expanded")
    contenders.batched(expanded, a_rows[:best["batch"]], best["batch"])
    e_labels, e_ms = contenders.timed(lambda: contenders.batched(expanded, a_rows, best["batch"]), len(a_rows))
    result["contenders"].append({"name": "C with the expanded working cache", "batch": best["batch"],
                                 "ms_per_row": e_ms, "agreement": _agreement(e_labels, a_labels)})
    _LOGGER.info("%s C expanded batch %d: %.1f ms/row", name, best["batch"], e_ms)

    _rounds(name, task, texts, warm, clf, best, result, a_labels, args)
    if "batch1" not in args.skip:
        result["batch_one"] = batch_one(name, clf, a_rows, args.rounds)
    for entry in result["contenders"]:
        entry["speedup_vs_a"] = a_ms / entry["ms_per_row"]
    result["floor"] = _floor(clf, task, texts, loaded, best)
    result["b_over_a"] = a_ms / b_ms
    result["c_over_b"] = b_ms / best["ms_per_row"]
    return result, a_labels


def _rounds(name, task, texts, warm, clf, best, result, a_labels, args) -> None:
    """C at its best batch, C with the exhaustive label search (sequence tasks) and D,
    timed in interleaved rounds on the same rows; each reports its best round, so drift
    of the machine's speed between sections does not move the ratios."""
    batch = best["batch"]
    runs: dict[str, list[float]] = {"C": [], "exhaustive": [], "D": []}
    outputs: dict[str, list] = {}
    exhaustive = clf.mode == "sequence" and clf.label_search == "pruned"
    run_d = None
    if "d" not in args.skip:
        # Fixed Beam batches several forward batches long. Left adaptive, BatchElements
        # starts small and tunes for a fixed per-batch overhead, but here every row gets
        # cheaper up to the full forward batch.
        beam_batch = args.d_beam_batches * batch
        transform = ClassifyText(task=task, model=args.model, batch_size=batch, min_batch_size=beam_batch,
                                 max_batch_size=beam_batch, verify=False, dtype=args.dtype)
        # loaded before timing (normally the benchmark's own model, seeded into the handle)
        holder = _MODEL_HANDLE.acquire(lambda: ModelHolder(transform.config), tag=transform.config.model_tag)
        run_d = contenders.classify_text(transform, [{"text": t} for t in texts])
        contenders.classify_text(transform, [{"text": t} for t in warm])()
    if exhaustive:
        contenders.batched_predictions(clf, warm, batch, exhaustive=True)
    for r in range(args.rounds):
        outputs["C"], ms = contenders.timed(lambda: contenders.batched_predictions(clf, texts, batch), len(texts))
        runs["C"].append(ms)
        if exhaustive:
            outputs["exhaustive"], ms = contenders.timed(
                lambda: contenders.batched_predictions(clf, texts, batch, exhaustive=True), len(texts))
            runs["exhaustive"].append(ms)
        if run_d is not None:
            outputs["D"], ms = contenders.timed(run_d, len(texts))
            runs["D"].append(ms)
        _LOGGER.info("%s round %d: %s", name, r + 1, {k: round(v[-1], 1) for k, v in runs.items() if v})
    result["rounds"] = {k: v for k, v in runs.items() if v}
    c_ms = min(runs["C"])
    if best["ms_per_row"] != best["ms_per_row"] or c_ms < best["ms_per_row"]:  # NaN: no sweep
        best.update(ms_per_row=c_ms, agreement=_agreement([p.label for p in outputs["C"]], a_labels))
    if exhaustive:
        pruned, full = outputs["C"], outputs["exhaustive"]
        ex_ms = min(runs["exhaustive"])
        result["contenders"].append({"name": "C with exhaustive label search", "batch": batch, "ms_per_row": ex_ms,
                                     "agreement": _agreement([p.label for p in full], a_labels)})
        result["pruned_vs_exhaustive"] = {
            "speedup": ex_ms / c_ms, "label_agreement": _agreement([p.label for p in pruned], [p.label for p in full]),
            "max_prob_diff": max(abs(p.scores[k] - f.scores[k]) for p, f in zip(pruned, full) for k in f.scores),
            "pruned_label_tokens_per_row": sum(p.label_tokens for p in pruned) / len(pruned),
            "exhaustive_label_tokens_per_row": clf.label_tokens,
            "suffix_tokens_per_row": sum(p.suffix_tokens - p.label_tokens for p in pruned) / len(pruned)}
    if run_d is not None:
        d_ms = min(runs["D"])
        result["contenders"].append({"name": "D ClassifyText, DirectRunner", "batch": batch,
                                     "beam_batch": args.d_beam_batches * batch, "ms_per_row": d_ms,
                                     "agreement": _agreement(outputs["D"], a_labels)})
        result["d_over_c_throughput"] = c_ms / d_ms
        del holder
    result["c_rounds_ms_per_row"] = c_ms


def _floor(clf, task, texts, loaded, best) -> dict:
    suffix_tokens = sum(len(clf.encode(t).suffix_ids) for t in texts) / len(texts)
    tokens = suffix_tokens + clf.label_tokens
    params = non_embedding_params(loaded.model)
    gflops = matmul_gflops(loaded.model, max(1, int(round(best["batch"] * tokens))))
    floor = floor_ms_per_row(params, tokens, gflops)
    other = other_flops_per_row(loaded.model.config, prefix_tokens=clf.prefix_length, suffix_tokens=suffix_tokens,
                                label_tokens=clf.label_tokens, labels=len(task.labels))
    floor_all = floor + other / (gflops * 1e9) * 1e3
    return {"non_embedding_params": params, "dynamic_tokens_per_row": tokens,
            "matmul_gflops": gflops, "floor_ms_per_row": floor,
            "c_percent_of_floor": 100.0 * floor / best["ms_per_row"],
            "other_gflop_per_row": other / 1e9, "floor_with_attention_ms_per_row": floor_all,
            "c_percent_of_floor_with_attention": 100.0 * floor_all / best["ms_per_row"]}


def _sliding(loaded, args) -> dict:
    """Batching on sliding-window layers: a model whose window (512) is shorter than the
    Banking77 prefix: the embedded model's shapes with random weights (or --sliding_model),
    C at several batches on both engines, and cached == full on a few rows."""
    from transformers import AutoModelForCausalLM, MistralConfig

    if args.sliding_model:
        model = load_model(args.sliding_model, dtype=args.dtype, threads=args.threads)
    else:
        c = loaded.model.config
        torch.manual_seed(0)
        config = MistralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                               intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                               max_position_embeddings=8192, sliding_window=512, tie_word_embeddings=True)
        model = LoadedModel(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval(),
                            loaded.tokenizer, "random Mistral-style, SmolLM2 shapes, window 512")
    task = TaskSpec.from_yaml(os.path.join(TASKS, "banking77.yaml")).replace(label_search="exhaustive")
    texts = [t for t, _ in csv_rows(args.banking77_csv, label="category")][:args.sliding_rows]
    out = {"model": model.model_id, "rows": len(texts), "runs": []}
    for engine in ("shared", "expanded"):
        clf = PrefixClassifier(task=task, loaded=model, verify=False, prefix_attention=engine)
        out["prefix_tokens"] = clf.prefix_length
        for batch in args.sliding_batch_sizes:
            contenders.batched(clf, texts[:batch], batch)
            _, ms = contenders.timed(lambda: contenders.batched(clf, texts, batch), len(texts))
            out["runs"].append({"engine": engine, "batch": batch, "ms_per_row": ms})
            _LOGGER.info("sliding %s batch %d: %.1f ms/row", engine, batch, ms)
        check = texts[:3]
        cached, full = clf.classify(check), clf.classify_full(check)
        out[f"{engine}_max_prob_diff_vs_full"] = max(abs(c.scores[k] - f.scores[k])
                                                     for c, f in zip(cached, full) for k in f.scores)
    return out


def _scaled_task(task: TaskSpec, pool: list[tuple[str, str]], target: int, tokenizer) -> TaskSpec:
    """The task with as many few-shot examples (cycled from `pool`) as reach ~`target`
    prefix tokens; no examples for the smallest target."""
    from beam_prefix.tasks.prompt import PromptLayout

    examples: list[Example] = []
    current = task.replace(examples=())
    while PromptLayout.build(current, tokenizer).prefix_length < target:
        step = max(1, len(examples))  # double the examples each time, then trim
        examples += [Example(text=t, label=l) for t, l in
                     (pool[(len(examples) + i) % len(pool)] for i in range(step))]
        current = task.replace(examples=tuple(examples))
    while len(examples) > 1:
        smaller = task.replace(examples=tuple(examples[:-1]))
        if PromptLayout.build(smaller, tokenizer).prefix_length < target:
            break
        examples, current = examples[:-1], smaller
    return current


def _scaling(loaded, args) -> list[dict]:
    task = TaskSpec.from_yaml(os.path.join(TASKS, "support_tickets.yaml"))
    pool = csv_rows(os.path.join(DATA, "sample_tickets.csv"))
    texts = [t for t, _ in pool]
    out = []
    for target in args.scaling_tokens:
        clf = PrefixClassifier(task=_scaled_task(task, pool, target, loaded.tokenizer), loaded=loaded,
                               verify=False)
        a_texts = texts[:args.scaling_a_rows]
        contenders.full_reencode(clf, a_texts[:1])
        _, a_ms = contenders.timed(lambda: contenders.full_reencode(clf, a_texts), len(a_texts))
        contenders.batched(clf, texts[:8], 16)
        _, c_ms = contenders.timed(lambda: contenders.batched(clf, texts, 16), len(texts))
        out.append({"target": target, "prefix_tokens": clf.prefix_length, "a_ms_per_row": a_ms,
                    "c_ms_per_row": c_ms})
        _LOGGER.info("scaling: prefix %d tokens: A %.1f ms/row, C %.1f ms/row", clf.prefix_length, a_ms, c_ms)
    return out


def _rss(args) -> dict:
    out = {}
    for threads in (1, 4):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.rss_worker", "--threads", str(threads),
                               "--rows", str(args.rss_rows), "--model", args.model],
                              cwd=ROOT, capture_output=True, text=True, check=True)
        out[threads] = json.loads(proc.stdout.strip().splitlines()[-1])["max_rss_mb"]
    return {"rss_mb_1_thread": out[1], "rss_mb_4_threads": out[4], "ratio": out[4] / out[1]}


def _native_bf16() -> bool:
    from beam_prefix.model.half_precision import native_bf16

    return native_bf16()


def _modes(loaded, workloads, reference: dict, c_ms: dict, args) -> list[dict]:
    out = []
    for mode in args.modes:
        if mode == "int8":
            model = copy.deepcopy(loaded.model)
            unpack_linears(model)  # dynamic quantization swaps layers of exactly nn.Linear's type
            head = model.get_output_embeddings()  # label rows are read from its weight: keep it float
            linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
            model = torch.ao.quantization.quantize_dynamic(model, linears, dtype=torch.qint8)
        elif mode == "bfloat16":
            model = copy.deepcopy(loaded.model).to(torch.bfloat16)
        else:
            raise SystemExit(f"unknown mode {mode!r} (int8, bfloat16)")
        variant = LoadedModel(model, loaded.tokenizer, f"{loaded.model_id}|{mode}")
        for name, (task, texts) in workloads.items():
            texts = texts[:len(reference[name])]  # A's rows: agreement is measured against A
            clf = PrefixClassifier(task=task, loaded=variant, verify=False)
            batch = c_ms[name]["batch"]
            contenders.batched(clf, texts[:8], batch)
            labels, ms = contenders.timed(lambda: contenders.batched(clf, texts, batch), len(texts))
            entry = {"mode": mode, "workload": name, "batch": batch, "ms_per_row": ms,
                     "fp32_ms_per_row": c_ms[name]["ms_per_row"], "agreement_with_a": _agreement(labels, reference[name]),
                     "native_bf16": _native_bf16() if mode == "bfloat16" else None}
            entry["faster_than_fp32"] = ms < c_ms[name]["ms_per_row"]
            # a mode earns its place only if it is faster here and still agrees with A
            entry["kept"] = entry["faster_than_fp32"] and entry["agreement_with_a"] >= 0.99
            out.append(entry)
            _LOGGER.info("mode %s on %s: %.1f ms/row (fp32 %.1f), agreement %.3f", mode, name, ms,
                         c_ms[name]["ms_per_row"], entry["agreement_with_a"])
    return out


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workloads", default="support,banking77", type=lambda s: s.split(","))
    parser.add_argument("--support_rows", type=int, default=600)
    parser.add_argument("--banking77_rows", type=int, default=300)
    parser.add_argument("--banking77_csv", default=os.path.join(DATA, "banking77", "test_sample.csv"))
    parser.add_argument("--a_rows", type=int, default=None, help="time A and B on the first N rows only")
    parser.add_argument("--banking77_a_rows", type=int, default=40,
                        help="the same for Banking77, where A takes seconds per row")
    parser.add_argument("--batch_sizes", default="1,8,32,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--banking77_batch_sizes", default="16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--d_beam_batches", type=int, default=4,
                        help="D's Beam batch, in forward batches (ClassifyText's defaults: 64 / 16)")
    parser.add_argument("--scaling_tokens", default="150,1000,4000", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--scaling_a_rows", type=int, default=8)
    parser.add_argument("--rss_rows", type=int, default=200)
    parser.add_argument("--modes", default="int8,bfloat16", type=lambda s: [m for m in s.split(",") if m])
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved rounds of C, C exhaustive and D (each reports its best)")
    parser.add_argument("--sliding_rows", type=int, default=16)
    parser.add_argument("--sliding_batch_sizes", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--sliding_model", default=None,
                        help="a real sliding-window model for that section (default: random weights)")
    parser.add_argument("--skip", default="", type=lambda s: set(x for x in s.split(",") if x),
                        help="any of: d, batch1, scaling, rss, modes, sliding")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out_dir", default=RESULTS)
    args = parser.parse_args(argv)

    loaded = load_model(args.model, dtype=args.dtype, threads=args.threads)
    workloads = _workloads(args)
    report = {"model": loaded.model_id, "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
                         + (", native bf16" if _native_bf16() else ", no native bf16"),
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "workloads": {}}
    # D gets this model through the process-wide handle: seed the handle, no second load
    held = None  # a strong reference keeps the seeded holder in the handle
    if workloads:
        config = ClassifyConfig(task=next(iter(workloads.values()))[0], model=args.model, dtype=args.dtype)
        held = _MODEL_HANDLE.acquire(lambda: ModelHolder(config, loaded=loaded), tag=config.model_tag)
    reference = {}  # A's labels per workload
    # the files are rewritten after every section: a long run cut short keeps what it measured
    for name, (task, texts) in workloads.items():
        report["workloads"][name], reference[name] = _bench_workload(name, task, texts, loaded, args)
        report_module.write(report, args.out_dir)
    if "sliding" not in args.skip and args.sliding_rows:
        report["sliding"] = _sliding(loaded, args)
        report_module.write(report, args.out_dir)
    if "scaling" not in args.skip and args.scaling_tokens:
        report["scaling"] = _scaling(loaded, args)
        report_module.write(report, args.out_dir)
    if "rss" not in args.skip:
        report["rss"] = _rss(args)
        report_module.write(report, args.out_dir)
    if "modes" not in args.skip and args.modes and workloads:
        best = {n: w["best_c"] for n, w in report["workloads"].items()}
        report["modes"] = _modes(loaded, workloads, reference, best, args)
    markdown = report_module.write(report, args.out_dir)
    print(markdown)
    del held
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("beam_prefix").setLevel(logging.WARNING)
    run()
