"""Half precision against float32 on the embedded model, on the CPU (#36).

    python -m benchmarks.precision [--rounds 3] [--threads 1]

Three precisions of the same model: ``float32``; ``bfloat16`` as the engine runs it now
(the base model's linear layers in bf16, everything else float32: `half_precision`); and
the model cast to bf16 whole (what ``dtype=bfloat16`` meant before), for reference.
For each, on rows that fit nothing:

- LM label scoring, the shipped support task (calibrated): the 66 held-out and 60 sample
  tickets; labels agreeing with float32's, probability differences from float32, and
  cached against full re-encoding of every row (the start-up self-check's measure, from
  which `half_precision.TOLERANCE` is set); held-out accuracy;
- LM label scoring over 77 labels (`banking77.yaml`, pruned label search): 256 test rows,
  agreement with float32 and the largest probability difference;
- extraction (`ticket_fields.yaml`) on the held-out tickets: generated tokens equal to full
  re-encoding's (the self-check's rule) and to float32's, and valid outputs.

Cost: ms per row at batch 64, `--threads` torch threads, best of `--rounds` interleaved
rounds in this one process: support LM scoring, and the Banking77 early-exit head (layers 6
and 12; for bf16 a head fit here on 10 training rows per intent, as accuracy does not
matter for cost). Writes `precision.json` and `precision.md` under `--out_dir`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

from benchmarks.data import DATA, RESULTS, TASKS, csv_rows, write_results

PRECISIONS = ("float32", "bfloat16 linears", "bfloat16 whole model")


def _models(loaded):
    """precision -> LoadedModel, all from one load (the half ones are copies)."""
    from beam_prefix.model.half_precision import half_linears
    from beam_prefix.model.loading import LoadedModel

    linears = copy.deepcopy(loaded.model)
    half_linears(linears, torch.bfloat16)
    whole = copy.deepcopy(loaded.model).to(torch.bfloat16)
    return {"float32": loaded, "bfloat16 linears": LoadedModel(linears, loaded.tokenizer, loaded.model_id),
            "bfloat16 whole model": LoadedModel(whole, loaded.tokenizer, loaded.model_id)}


def _differences(preds, reference) -> dict:
    diffs = [abs(a.scores[k] - b.scores[k]) for a, b in zip(preds, reference) for k in a.scores]
    return {"label_agreement": round(sum(a.label == b.label for a, b in zip(preds, reference)) / len(preds), 4),
            "max_prob_diff": round(max(diffs), 5), "mean_prob_diff": round(sum(diffs) / len(diffs), 6)}


def _lm_scoring(models, task_file, texts, gold=None, full_rows=0) -> dict:
    from beam_prefix import PrefixClassifier, TaskSpec

    out, reference = {}, None
    for name, loaded in models.items():
        clf = PrefixClassifier(task=TaskSpec.from_yaml(os.path.join(TASKS, task_file)), loaded=loaded, batch_size=64,
                               verify=False)
        preds = clf.classify(texts)
        reference = reference or preds
        row = _differences(preds, reference) if name != "float32" else {}
        if full_rows:
            full = clf.classify_full(texts[:full_rows])
            row["cached_vs_full"] = _differences(preds[:full_rows], full)
        if gold is not None:
            row["heldout_accuracy"] = round(sum(p.label == g for p, g in zip(preds, gold)) / len(gold), 4)
        out[name] = row
        print(task_file, name, row, flush=True)
    return out


def _extraction(models, texts) -> dict:
    from beam_prefix.engines.extractor import Extractor

    out, reference = {}, None
    for name, loaded in models.items():
        ex = Extractor(task=Extractor._read_task(os.path.join(TASKS, "ticket_fields.yaml")), loaded=loaded,
                       batch_size=16, verify=False)
        cached, full = ex.extract(texts), ex.extract_full(texts)
        reference = reference or cached
        out[name] = {"tokens_equal_to_full": sum(c.tokens == f.tokens for c, f in zip(cached, full)),
                     "tokens_equal_to_float32": sum(c.tokens == r.tokens for c, r in zip(cached, reference)),
                     "valid": sum(c.values is not None for c in cached), "rows": len(texts)}
        print("extraction", name, out[name], flush=True)
    return out


def _cost(models, bank: list[str], rounds: int, threads: int) -> dict:
    from beam_prefix import PrefixClassifier, TaskSpec, fit_head
    from benchmarks.baselines import _few

    few = _few(csv_rows(os.path.join(DATA, "banking77", "train.csv"), label="category"))
    tickets = [t for t, _ in csv_rows(os.path.join(DATA, "sample_tickets.csv"))] * 4
    fast = TaskSpec.from_yaml(os.path.join(TASKS, "banking77_fast_head.yaml"))
    contenders = {}
    for name in ("float32", "bfloat16 linears"):
        loaded = models[name]
        support = PrefixClassifier(task=TaskSpec.from_yaml(os.path.join(TASKS, "support_tickets.yaml")),
                                   loaded=loaded, batch_size=64, verify=False)
        head = fast.head
        if name != "float32":  # a head fits the precision it runs in
            base = PrefixClassifier(task=fast.replace(scoring="auto", head=None), loaded=loaded, batch_size=64,
                                    verify=False)
            head = fit_head(base, [t for t, _ in few], [g for _, g in few], layers=head.layers, pooling=head.pooling)
        early = PrefixClassifier(task=fast.replace(head=head), loaded=loaded, batch_size=64, verify=False)
        contenders[("support LM scoring", name)] = (support, tickets)
        contenders[("Banking77 early-exit head", name)] = (early, bank)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times: dict = {key: [] for key in contenders}
        for clf, texts in contenders.values():
            clf.classify(texts[:64])  # warm-up
        for _ in range(rounds):
            for key, (clf, texts) in contenders.items():
                start = time.perf_counter()
                clf.classify(texts)
                times[key].append(round(1e3 * (time.perf_counter() - start) / len(texts), 3))
    finally:
        torch.set_num_threads(previous)
    out = {}
    for (what, name), values in times.items():
        out.setdefault(what, {})[name] = {"ms_per_row_rounds": values, "ms_per_row_best": min(values)}
    for what, row in out.items():
        row["float32 / bfloat16 linears"] = round(row["float32"]["ms_per_row_best"]
                                                  / row["bfloat16 linears"]["ms_per_row_best"], 2)
    print(json.dumps(out, indent=1), flush=True)
    return out


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out_dir", default=RESULTS)
    args = parser.parse_args(argv)
    from beam_prefix.model.loading import load_model

    models = _models(load_model("embedded", prepack=False))  # plain linears: the same GEMMs the copies replace
    held = csv_rows(os.path.join(DATA, "heldout_tickets.csv"))
    tickets = [t for t, _ in held] + [t for t, _ in csv_rows(os.path.join(DATA, "sample_tickets.csv"))]
    bank = [t for t, _ in csv_rows(os.path.join(DATA, "banking77", "test.csv"), label="category")[:256]]
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "torch": torch.__version__,
              "support_rows": len(tickets), "heldout_rows": len(held), "bank_rows": len(bank),
              "support": _lm_scoring(models, "support_tickets.yaml", tickets, full_rows=len(tickets)),
              "support_heldout": _lm_scoring(models, "support_tickets.yaml", [t for t, _ in held],
                                             gold=[g for _, g in held]),
              "banking77_lm": _lm_scoring(models, "banking77.yaml", bank),
              "extraction": _extraction(models, [t for t, _ in held]),
              "cost": _cost(models, bank, args.rounds, args.threads), "threads": args.threads}
    _write(report, args.out_dir)
    return report


def _write(report: dict, out_dir: str) -> None:
    s, h, b, e = report["support"], report["support_heldout"], report["banking77_lm"], report["extraction"]
    lines = [f"# Half precision against float32, embedded model on the CPU ({report['date']}, {report['cpus']} CPUs, "
             f"torch {report['torch']})", "",
             "| | float32 | bfloat16 linears (the engine's bf16) | bfloat16 whole model (before) |",
             "| --- | --- | --- | --- |"]

    def row(title, fn):
        lines.append(f"| {title} | " + " | ".join(fn(p) for p in PRECISIONS) + " |")

    row(f"support LM scoring, {report['support_rows']} tickets: labels as float32's",
        lambda p: "-" if p == "float32" else f"{s[p]['label_agreement']:.1%}")
    row("max / mean probability difference from float32",
        lambda p: "-" if p == "float32" else f"{s[p]['max_prob_diff']:.3f} / {s[p]['mean_prob_diff']:.4f}")
    row("cached vs full re-encoding: max probability difference (labels equal)",
        lambda p: f"{s[p]['cached_vs_full']['max_prob_diff']:.2g} ({s[p]['cached_vs_full']['label_agreement']:.1%})")
    row(f"support held-out accuracy ({report['heldout_rows']} tickets)", lambda p: f"{h[p]['heldout_accuracy']:.1%}")
    row(f"Banking77 LM scoring, 77 labels, {report['bank_rows']} test rows: labels as float32's",
        lambda p: "-" if p == "float32" else f"{b[p]['label_agreement']:.1%} (max diff {b[p]['max_prob_diff']:.3f})")
    row(f"extraction, {report['heldout_rows']} held-out: tokens equal to full re-encoding / to float32 / valid",
        lambda p: f"{e[p]['tokens_equal_to_full']} / {e[p]['tokens_equal_to_float32']} / {e[p]['valid']}")
    for what, c in report["cost"].items():
        row(f"{what}: ms/row, batch 64, {report['threads']} thread(s)",
            lambda p: f"{c[p]['ms_per_row_best']}" if p in c else "-")
    lines += ["", "Speed-up of bfloat16 linears over float32: " + "; ".join(
        f"{what} {c['float32 / bfloat16 linears']}x" for what, c in report["cost"].items()) + "."]
    write_results(out_dir, "precision", report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    run()
