"""Tune the model on labelled rows, then fit a head on the tuned model: one directory out.

    python -m beam_prefix.pipelines.tune --task banking77_fast_head --input pipelines/data/banking77/train.csv \\
        --label_column category --output banking77_tuned/ --label_rows true
    python -m beam_prefix.pipelines.classify --model banking77_tuned/ --task banking77_tuned/banking77_fast_head.yaml ...

In this process (a CPU tunes thousands of short rows in minutes; no Beam pipeline): reads the
local input files (CSV, JSON Lines, Parquet: `pipelines.local_rows`), holds out a stratified
`--holdout` share of each label's rows (0.2 by default), then, on the other rows,

1. fits a head on the base model (`fit_head`, the folds choose C and the n-gram weight):
   the "before" of the summary, and the n-gram weight the tuned head takes (its own folds
   would run over rows the tuning saw: `beam_prefix.engines.model_tuning`);
2. tunes the decoder layers up to the deepest one the head reads (`tune_model`; progress on
   the console: a bar on a terminal, log lines elsewhere);
3. fits the head on the tuned model with that n-gram weight;
4. compares the two heads on the held-out rows, which tuned and fit nothing. The tuned model
   is kept only when its head is more accurate there; its head is then fit again on every
   row. Otherwise the run says so, discards the tuned model and writes the untuned head
   (fit on every row, as `pipelines.fit` fits it) with a task file naming the base model;
   either way it exits 0, and the summary's ``validation`` says
   ``{rows, untuned_accuracy, tuned_accuracy, kept}``. ``--holdout 0`` skips the check (and
   keeps the tuned model unproven).

Tuning runs in float32 on the CPU; `--dtype bfloat16` fits both heads on the
model loaded in that precision, so the written head answers with the tuned model loaded in
bfloat16 (a head answers only in the precision it was fit in; it records it, and classify
runs in it when given no --dtype).

`--output` is a new directory (it must not exist, or be empty; so it is never a path the run
reads), written all or nothing: the tuned model (safetensors, tokenizer, tuning record), the
head file ``<task>.head`` and the task file ``<task>.yaml`` that answers with it (or, when
the tuning lost, the head and task file alone). The
layers and pooling default to those of the head the task file names, else -1 and last.
Every input row is used or the run refuses (a row with no text or label is an error,
naming how many). Exit statuses as the other pipelines: 0 done, 1 the run failed, 2 bad
flags or input.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import shutil
import sys
import time
from typing import Any

import yaml

from beam_prefix.model.tuning_record import LABELS_PER_BATCH
from beam_prefix.tasks.shipped import resolve_task
from beam_prefix.tasks.task_file import file_name_of, read_task_file
from beam_prefix.pipelines.launch import exit_process, in_process_main, invoked_as
from beam_prefix.pipelines.launch_checks import (Read, hold_outputs, model_reads, refuse_inside, refuse_overlap,
                                                 refuse_package, task_reads)
from beam_prefix.pipelines.progress import TuningProgress
from beam_prefix.pipelines.publish import Output
from beam_prefix.pipelines.local_rows import local_columns, local_paths
from beam_prefix.pipelines.options import INPUT_FORMATS, join_negative_lists, parse_layers, task_without_head
from beam_prefix.pipelines.sources import format_of
from beam_prefix.pipelines.summary import write_json

__all__ = ["run", "main", "parser"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.tune")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=invoked_as("tune"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--task", default=None, help="Task YAML path or shipped task name (its labels and prompt).")
    p.add_argument("--input", required=True, help="Local input file(s) (glob), CSV, JSON Lines or Parquet.")
    p.add_argument("--input_format", default=None, choices=INPUT_FORMATS,
                   help="Input format; default from the extension (.csv, .jsonl/.json, else parquet).")
    p.add_argument("--text_column", default="text", help="Column holding the text.")
    p.add_argument("--label_column", required=True, help="Column holding each row's label.")
    p.add_argument("--output", required=True, help="The directory to write (must not exist, or be empty).")
    p.add_argument("--model", default="embedded", help="The model to tune: 'embedded', a local directory, a hub id.")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="Precision the heads are fit in, so the one the tuned model answers in (the head records "
                        "it: classify runs in it by default); the tuning itself runs in float32. float16 is refused: this runs on the CPU.")
    p.add_argument("--layers", default=None,
                   help="Hidden-state indices the head reads, comma-separated (default: the task's head's, else -1).")
    p.add_argument("--pooling", default=None, choices=("last", "mean"),
                   help="How the head pools a row's states (default: the task's head's, else last).")
    p.add_argument("--label_rows", default="false", choices=("true", "false"),
                   help="The heads also train on the task's own words (as pipelines.fit --label_rows).")
    p.add_argument("--epochs", type=int, default=4, help="Passes over the rows (default 4).")
    p.add_argument("--learning_rate", type=float, default=1e-4, help="AdamW learning rate (default 1e-4).")
    p.add_argument("--temperature", type=float, default=0.1, help="Contrastive loss temperature (default 0.1).")
    p.add_argument("--labels_per_batch", type=int, default=LABELS_PER_BATCH,
                   help=f"Labels in each tuning batch, 4 rows each (default {LABELS_PER_BATCH}).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the batches and the weights' updates.")
    p.add_argument("--folds", type=int, default=5, help="Folds that choose the heads' regularisation.")
    p.add_argument("--holdout", type=float, default=0.2,
                   help="Share of each label's rows held out of the tuning and the heads to check them (default "
                        "0.2, at least one row of a label with two or more): the tuned model is kept only when its "
                        "head beats the untuned head on them, else the untuned head is written. 0: no check.")
    p.add_argument("--torch_threads", type=int, default=None, help="torch intra-op threads for this process.")
    p.add_argument("--summary_output", default=None, help="Also write the summary JSON here.")
    return p


def _rows(args) -> tuple[list[str], list[str]]:
    """The rows' texts and labels; every row must be one classify would read (the engine's
    own text checks: `clean_text`) with a label, or the run is refused naming how many are not."""
    paths = local_paths(args.input, "--input")
    if not paths:
        raise ValueError(f"--input={args.input!r} matches no local file (pipelines.tune reads local files)")
    rows = local_columns(paths, format_of(args.input, args.input_format), [args.text_column, args.label_column])
    reasons: collections.Counter = collections.Counter()
    first = None
    for i, r in enumerate(rows):
        why = "unparseable" if r is None else "no_label" if r[1] in (None, "") else _text_error(r[0])
        if why:
            reasons[why] += 1
            first = i if first is None else first
    if reasons:
        raise ValueError(f"{sum(reasons.values())} of {len(rows)} input rows cannot train "
                         f"({', '.join(f'{n} {why}' for why, n in reasons.most_common())}; {args.text_column!r} text, "
                         f"{args.label_column!r} label), first at row {first}; a tuning uses every row: fix or drop them")
    return [str(r[0]) for r in rows], [str(r[1]) for r in rows]


def _text_error(text) -> str | None:
    """The reason classify would fail a row with this text (`clean_text`), or None."""
    from beam_prefix.errors import RowError
    from beam_prefix.tasks.prompt import clean_text

    try:
        clean_text(text)
    except RowError as e:
        return e.reason
    return None


def _check_launch(args, task_file: str, task, layers: tuple[int, ...]) -> list[Output]:
    """What this run writes, checked against what it reads before any model work: the task's
    name as a file name, the layers on the model, the summary outside the output directory
    and off every file read. Returns the outputs (to lock)."""
    from beam_prefix.model.early_exit import check_layers
    from beam_prefix.model.loading import load_config

    file_name_of(task.name)  # it names the head and task files written: never a path
    config = load_config(args.model)
    states = check_layers(config, layers, what="--layers", model=args.model)
    if 0 in states:
        raise ValueError(f"--layers={','.join(map(str, layers))}: hidden state 0 (index "
                         f"{layers[states.index(0)]}) is the token embeddings, which no decoder layer computes: "
                         f"nothing there to tune; read layers of 1 or more")
    outputs = [Output("--output", args.output)]
    refuse_package(outputs)  # (the summary's place is checked with the reads below)
    if args.summary_output:
        summary = Output("--summary_output", args.summary_output)
        refuse_inside(summary, "--output", args.output)
        outputs.append(summary)
    reads = [Read("--input", args.input), *task_reads(task_file), *model_reads(args.model)]
    refuse_overlap(outputs[1:], reads)  # (--output is new or empty: nothing in it is read)
    return outputs


def run(argv: list[str] | None = None) -> dict:
    """Tune, fit, write the directory; returns the summary."""
    from beam_prefix.engines.head_fitting import check_labels
    from beam_prefix.engines.model_tuning import check_settings
    from beam_prefix.model.loading import check_device

    args = parser().parse_args(join_negative_lists(list(sys.argv[1:] if argv is None else argv), ("--layers",)))
    if "://" in args.output:
        raise ValueError(f"--output={args.output!r}: pipelines.tune writes a local directory")
    if os.path.islink(args.output.rstrip("/") or "/"):  # it is replaced by the directory built beside it
        raise ValueError(f"--output={args.output!r} is a symbolic link (to {os.readlink(args.output.rstrip('/'))!r}); "
                         f"pipelines.tune writes a new directory in its place: give the directory's own path")
    # a new or empty --output: so it never writes over the model, the task or the input it reads
    check_settings(model=args.model, pooling=args.pooling or "mean", epochs=args.epochs,
                   learning_rate=args.learning_rate, temperature=args.temperature, output_dir=args.output,
                   labels_per_batch=args.labels_per_batch)
    if args.folds < 2:
        raise ValueError(f"--folds must be >= 2, got {args.folds}")
    if not 0 <= args.holdout < 1:
        raise ValueError(f"--holdout must be in [0, 1), got {args.holdout}")
    check_device("cpu", args.dtype)  # load_model's default device, where this tunes and fits
    task_file = resolve_task(args.task or "support_tickets")
    # read once: the task, its head's layers and the task file written beside the tuned model
    # (minutes later) all come from the same document
    task_data = read_task_file(task_file)
    task = task_without_head(task_file, task_data)
    named = _named_head(task_file, task_data)
    layers = parse_layers(args.layers) if args.layers else tuple(named.layers) if named else (-1,)
    pooling = args.pooling or (named.pooling if named else "last")
    outputs = _check_launch(args, task_file, task, layers)
    texts, labels = _rows(args)
    check_labels(task, labels)  # before any model work
    check_holdout(labels, args.holdout, args.seed)
    with contextlib.ExitStack() as held:
        hold_outputs(held, outputs)  # a second tuning into the same directory is refused
        return _tune(args, task_file, task_data, task, layers, pooling, texts, labels)


def holdout_split(labels: list[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Row indices (train, held out): of each label's rows, round(fraction x n) held out,
    at least one where the label has two rows or more, never its last (every label keeps a
    training row); a label with one row is never held out. Seeded, so a rerun holds out
    the same rows."""
    import random

    rng = random.Random(seed)
    by_label: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        by_label.setdefault(label, []).append(i)
    held = []
    for label in sorted(by_label):
        rows = by_label[label]
        n = min(len(rows) - 1, max(1, round(fraction * len(rows)))) if fraction > 0 and len(rows) > 1 else 0
        held += rng.sample(rows, n)
    held_set = set(held)
    return [i for i in range(len(labels)) if i not in held_set], sorted(held)


def _kept(n: int, fraction: float) -> int:
    """Training rows `holdout_split` leaves a label of `n` rows."""
    return n - (min(n - 1, max(1, round(fraction * n))) if fraction > 0 and n > 1 else 0)


def check_holdout(labels: list[str], fraction: float, seed: int) -> None:
    """Refuse, at launch, a hold-out that leaves no label two training rows (a contrastive
    tuning needs a pair of one label's rows), saying how many rows a label needs at this
    `fraction` and which labels have too few.

    Raises:
        ValueError: naming --holdout, the rows a label needs and the labels short of them.
    """
    counts = collections.Counter(labels)
    train, _ = holdout_split(labels, fraction, seed)
    if max(collections.Counter(labels[i] for i in train).values()) >= 2:
        return
    need = next((n for n in range(2, 100_000) if _kept(n, fraction) >= 2), None)
    short = sorted((label for label in counts if _kept(counts[label], fraction) < 2), key=lambda x: (counts[x], x))
    listed = ", ".join(f"{label} ({counts[label]})" for label in short[:10]) + (
        f" and {len(short) - 10} more" if len(short) > 10 else "")
    needs = (f"a label needs {need} rows or more to keep two for the tuning beside those held out" if need else
             "no label keeps two rows at this share")
    raise ValueError(f"--holdout {fraction:g} leaves no label two training rows, and a contrastive tuning needs a pair "
                     f"of one label's rows: {needs}; labels with too few (rows): {listed}; add rows, or lower "
                     f"--holdout (0 skips the held-out check)")


def _accuracy(task, loaded, head, texts: list[str], labels: list[str]) -> float:
    """The share of `texts` that `head`, answering on `loaded`, labels as `labels` says."""
    from beam_prefix import PrefixClassifier

    clf = PrefixClassifier(task=task.replace(scoring="head", head=head, calibration=False), loaded=loaded, verify=False)
    return sum(p.label == gold for p, gold in zip(clf.classify(texts), labels)) / len(texts)


def _tune(args, task_file: str, task_data, task, layers, pooling: str, texts: list[str], labels: list[str]) -> dict:
    """The tuning and the heads, once the flags, the rows and the outputs are checked and
    locked. With a holdout, the tuned model is kept only when its head beats the untuned
    head on the held-out rows (neither tuned nor fit on them); the written head is then fit
    on every row."""
    from beam_prefix import PrefixClassifier, TaskSpec, fit_head
    from beam_prefix.engines.model_tuning import tune_model
    from beam_prefix.model.loading import load_model, set_torch_threads

    set_torch_threads(args.torch_threads)
    label_rows = args.label_rows == "true"
    fit = dict(layers=layers, pooling=pooling, folds=args.folds, label_rows=label_rows)
    train, held = holdout_split(labels, args.holdout, args.seed)
    train_texts, train_labels = [texts[i] for i in train], [labels[i] for i in train]
    held_texts, held_labels = [texts[i] for i in held], [labels[i] for i in held]
    summary: dict = {"output": args.output, "task": task.name, "base_model": args.model, "rows": len(texts),
                     "tuning_rows": len(train), "layers": list(layers), "pooling": pooling, "label_rows": label_rows,
                     "dtype": args.dtype}
    start = time.perf_counter()
    # the self-check compares what the heads read (the features at their layers, cached ==
    # full re-encoding), not LM label scores, which nothing here answers with and whose check
    # re-encodes each probe once per label (31 s against 3.7 s on Banking77's 77 labels, 2
    # cores). In half precision the heads are checked as they will answer instead (below)
    half = args.dtype != "float32"
    features = dict(check_layers=layers, check_pooling=pooling)
    base_loaded = load_model(args.model, dtype=args.dtype)
    base = PrefixClassifier(task=task.replace(calibration=False), loaded=base_loaded, verify=not half, **features)
    before = fit_head(base, train_texts, train_labels, **fit)
    alpha = before.lexical.alpha if before.lexical is not None else 0.0
    summary["base_head"] = _facts(before)
    untuned = _accuracy(task, base_loaded, before, held_texts, held_labels) if held else None
    _LOGGER.info("base model's head: %s-fold accuracy %s, n-grams weighed %s%s", before.metrics.get("folds"),
                 before.metrics.get("kfold_accuracy"), alpha,
                 f"; {untuned:.1%} on {len(held)} held-out rows" if held else "")
    # everything this run writes is built in one folder beside --output, renamed into place at
    # the end; named after --output (whose lock this run holds), so the next tuning into it
    # removes what a killed one left
    parent = os.path.dirname(os.path.abspath(args.output))
    work = os.path.join(parent, f".{os.path.basename(os.path.abspath(args.output))}.tuning")
    if os.path.exists(work):
        _LOGGER.info("removing %s, left by an earlier tuning into %s that was killed", work, args.output)
        shutil.rmtree(work)
    staging = os.path.join(work, "model")
    progress = TuningProgress(epochs=args.epochs, logger=_LOGGER)
    try:
        try:
            record = tune_model(task, train_texts, train_labels, output_dir=staging, model=args.model, layers=layers,
                                pooling=pooling, epochs=args.epochs, learning_rate=args.learning_rate,
                                temperature=args.temperature, seed=args.seed, base_lexical_alpha=alpha,
                                labels_per_batch=args.labels_per_batch, log=_LOGGER.info, progress=progress)
        finally:
            progress.close()
        # the tuned model's self-check in float32: its features cached == full re-encoding
        loaded = load_model(staging)
        tuned = PrefixClassifier(task=task.replace(calibration=False), loaded=loaded, **features)
        if half:
            loaded = load_model(staging, dtype=args.dtype)
            tuned = PrefixClassifier(task=task.replace(calibration=False), loaded=loaded, verify=False)
        kept = True
        if held:
            tuned_head = fit_head(tuned, train_texts, train_labels, **fit, lexical_alpha=alpha)
            tuned_accuracy = _accuracy(task, loaded, tuned_head, held_texts, held_labels)
            kept = tuned_accuracy > untuned
            summary["validation"] = {"rows": len(held), "untuned_accuracy": round(untuned, 4),
                                     "tuned_accuracy": round(tuned_accuracy, 4), "kept": kept}
        head_name, task_name = f"{task.name}.head", f"{task.name}.yaml"
        if kept:  # the head on every row, the n-gram weight the base model's folds chose
            head = fit_head(tuned, texts, labels, **fit, lexical_alpha=alpha)
            answer, model = loaded, record.id
            out = staging
        else:  # the untuned head, fit on every row as pipelines.fit fits it, beside no model
            head = fit_head(base, texts, labels, **fit)
            answer, model = base_loaded, _model_spec(args.model)
            out = os.path.join(work, "untuned")
            os.makedirs(out)
        head.save(os.path.join(out, head_name))
        with open(os.path.join(out, task_name), "w", encoding="utf-8") as f:
            f.write(_task_yaml(task_file, task_data, task.name, head_name, model, args.dtype, tuned=kept))
        if half or not kept:  # the written head's self-check as classify runs it
            PrefixClassifier(task=TaskSpec.from_yaml(os.path.join(out, task_name)), loaded=answer, verify=True)
        summary.update(kept=kept, model_id=record.id if kept else None, tuned_layers=record.tuned_layers,
                       epochs=record.epochs, losses=list(record.losses), tune_s=record.tune_s, tuned_head=_facts(head),
                       head=os.path.join(args.output, head_name), task_file=os.path.join(args.output, task_name),
                       total_s=round(time.perf_counter() - start, 1))
        if args.summary_output:  # before the directory is published: a summary that fails publishes nothing
            write_json(summary, args.summary_output)
        try:
            if os.path.isdir(args.output):
                os.rmdir(args.output)  # empty (checked at launch)
            os.rename(out, args.output)
        except BaseException:
            if args.summary_output:
                with contextlib.suppress(OSError):
                    os.remove(args.summary_output)
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def _model_spec(model: str) -> str:
    """`model` as a task file names it: the model the user gave, read the way `load_model`
    reads it: ``embedded`` and URLs as given (never a folder of that name in the working
    directory), a local directory or file by its absolute path (a task file's model is read
    from wherever classify runs), anything else (a hub id) as given."""
    from beam_prefix.model.loading import EMBEDDED

    if model == EMBEDDED or "://" in model:
        return model
    return os.path.abspath(model) if os.path.exists(model) else model


def _named_head(task_file: str, data: Any):
    """The head the task file (parsed: ``data``) names, if it names one that loads (its layers
    and pooling); a relative head path is read beside the task file."""
    from beam_prefix.tasks.task import TaskSpec

    try:
        return TaskSpec.from_yaml(task_file, data=data).head
    except Exception:  # noqa: BLE001 - no head yet, or one for another model: the defaults
        return None


def _task_yaml(task_file: str, data: dict, name: str, head_name: str, model: str, dtype: str, *,
               tuned: bool = True) -> str:
    """The task file's task (parsed: ``data``), answered by the head beside it: on the tuned
    model of this directory, or (`tuned` false: the tuning lost on the held-out rows) on the
    base model, which the task file then names."""
    keep = {k: v for k, v in data.items() if k not in ("head", "scoring", "calibration", "model")}
    if tuned:
        data = {**keep, "name": name, "scoring": "head", "head": head_name}
        said = (f"its head answers only with the\n# tuned model of this directory (model id {model}) in {dtype}; run "
                f"with --model <this directory>.")
    else:
        data = {**keep, "name": name, "model": model, "scoring": "head", "head": head_name}
        said = (f"the tuning did not beat the\n# untuned head on held-out rows, so this is the untuned head, on model "
                f"{model} in {dtype}; run with --task <this file>.")
    return (f"# Written by pipelines.tune from {os.path.basename(task_file)}: {said}\n"
            + yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def _facts(head) -> dict:
    m = head.metrics
    return {"kfold_accuracy": m.get("kfold_accuracy"), "kfold_accuracy_hidden_states": m.get("kfold_accuracy_hidden_states"),
            "C": m.get("C"), "lexical_alpha": head.lexical.alpha if head.lexical is not None else 0.0,
            "folds": m.get("folds")}


def main(argv: list[str] | None = None) -> int:
    """Run from the command line: 0 done, 1 the run failed, 2 bad flags or input."""
    return in_process_main(argv, run, _format, logger=_LOGGER)


def _format(s: dict) -> str:
    b, t, v = s["base_head"], s["tuned_head"], s.get("validation")
    answer = "" if s["dtype"] == "float32" else f" (fit in {s['dtype']}, which classify follows)"
    tuning = (f"layers 1-{s['tuned_layers']} tuned on {s['tuning_rows']} rows, {s['epochs']} epochs, "
              f"{s['tune_s']:.0f} s, loss {s['losses'][0]} -> {s['losses'][-1]}")
    checked = "" if v is None else (
        f"held-out check ({v['rows']} rows that neither tuned nor fit anything): untuned head "
        f"{v['untuned_accuracy']:.1%}, tuned {v['tuned_accuracy']:.1%}\n")
    if not s["kept"]:
        return (checked + f"the tuning did not beat the untuned head: kept the untuned head ({tuning}; discarded)\n"
                f"written: {s['output']}: head {s['head']}{answer}, task {s['task_file']} (on model "
                f"{s['base_model']}: classify with --task {s['task_file']})")
    lines = [checked + f"tuned model written: {s['output']} (model id {s['model_id']}; {tuning})",
             f"head: {s['head']}{answer}; task: {s['task_file']}",
             f"base model's head: {b['folds']}-fold accuracy {b['kfold_accuracy']}, n-grams weighed "
             f"{b['lexical_alpha']:g}",
             f"tuned model's head: n-grams weighed {t['lexical_alpha']:g} (the base's); its folds ran over rows the "
             f"tuning saw, so its fold accuracy ({t['kfold_accuracy']}) overrates it"]
    if v is None:
        lines.append("not checked on held-out rows (--holdout 0): measure on rows that tuned nothing")
    return "\n".join(lines)


def console_main() -> None:
    """The ``beam-prefix-tune`` console script: `main`, and the process ends with its status."""
    exit_process(main())


if __name__ == "__main__":
    console_main()
