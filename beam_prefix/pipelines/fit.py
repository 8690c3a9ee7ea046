"""Fit a trained head for a classification task from labelled rows.

    python -m beam_prefix.pipelines.fit --task support_tickets \\
        --input pipelines/data/sample_tickets.csv --label_column label --output support_tickets.head
    python -m beam_prefix.pipelines.fit --task banking77_head --input train.csv --label_column category \\
        --output banking77.head --runner=DataflowRunner ...   # features on any runner

The rows are read with the same flags and IO layer as the other pipelines; each row's
features (`beam_prefix.beam.embed_transform.EmbedText`: the hidden state(s) at its last prompt
position, the same batched cached engine) are computed by a Beam pipeline and staged
beside the output, on its file system (`pipelines.fit_io`: local, gs:// or any Beam
FileSystem); then, in this process, a multinomial logistic regression is fit on
them (scikit-learn's `LogisticRegressionCV`: the regularisation chosen by stratified
k-fold cross-validation on standardised features) and written as a head file
(`beam_prefix.tasks.trained_head`) with the fold accuracy and per-label F1. The label column is
checked before any model work: labels the task lacks, task labels with no row, fewer than
two classes. Exit statuses as the other pipelines: 0 done, 1 the run failed, 2 bad flags
or input.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix.beam.embed_transform import FEATURES_COLUMN, EmbedText
from beam_prefix.engines import feature_search
from beam_prefix.engines.head_fitting import check_labels, fit_head_from_features as fit_head, task_label_rows
from beam_prefix.model.loading import EMBEDDED, precision_of
from beam_prefix.tasks.shipped import resolve_task
from beam_prefix.tasks.trained_head import feature_fingerprint, text_hash
from beam_prefix.pipelines import bigquery_endpoint, fit_extraction, fit_search
from beam_prefix.pipelines.fit_io import FeatureStaging, write_head
from beam_prefix.pipelines.launch import exit_process, in_process_main, invoked_as, run_to_end
from beam_prefix.pipelines.local_rows import local_columns, local_paths
from beam_prefix.pipelines.summary import write_json
from beam_prefix.pipelines.options import (StepOptions, join_negative_lists, parse_layers, refuse_local_paths, refuse_unknown_flags,
                               task_without_head)
from beam_prefix.pipelines.publish import Output
from beam_prefix.pipelines.launch_checks import (hold_outputs, refuse_collisions, refuse_overlap, refuse_unreachable,
                                                 remote_paths, run_models, run_reads)
from beam_prefix.pipelines.model_staging import stage_for_workers
from beam_prefix.pipelines.sources import input_format, read_rows, require_columns, input_schema

__all__ = ["FitOptions", "run", "main", "fit_head", "check_labels"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.fit")

# the shared flags that are about row outputs, which a fit does not write (its one output is
# the head file): refused when given rather than ignored, so the fit Flex Template's
# parameters are exactly what the run reads
NOT_FOR_FIT = ("columns_to_keep", "output_format", "output_table", "failed_output", "failed_output_table",
               "bigquery_write_method")


class FitOptions(PipelineOptions):
    """Flags of the fit pipeline beyond the shared ones (`StepOptions`; --output is the head file)."""

    @classmethod
    def _add_argparse_args(cls, parser):
        group = parser.add_argument_group("fitting a head")
        group.add_argument("--label_column", default=None, help="pipelines.fit: the column holding each row's label.")
        group.add_argument("--layers", default=None,
                           help="pipelines.fit: hidden-state indices the head reads, comma-separated: -1 the final "
                                "normalised state; e.g. -1,20 adds layer 20. Default: chosen by folds with the "
                                "pooling among a few candidates (see --prefer), in --dtype's precision, unless "
                                "--layers or --pooling is given (then -1).")
        group.add_argument("--pooling", default=None, choices=("last", "mean"),
                           help="pipelines.fit: the hidden states at each row's last position (last) or their mean "
                                "over the row's own (suffix) positions (mean). Default: chosen by folds with the "
                                "layers, unless --layers or --pooling is given (then last).")
        group.add_argument("--prefer", default=None, choices=("accuracy", "balanced", "cost"),
                           help="pipelines.fit, features chosen by folds: the most accurate candidate (accuracy), "
                                "or the cheapest per row within 0.5 (balanced, default) or 2 (cost) points of "
                                "its fold accuracy. Refused with --layers or --pooling, which choose the features.")
        group.add_argument("--lexical", default="true", choices=("true", "false"),
                           help="pipelines.fit: also fit a regression on the rows' word and character n-grams and "
                                "weigh it beside the hidden states by the same folds (true, default; the folds may "
                                "give it weight 0, and then the head has none), or not (false).")
        group.add_argument("--label_rows", default="auto", choices=("auto", "true", "false"),
                           help="pipelines.fit: also train on the task's own words, each label's name read as text "
                                "(card_arrival as 'card arrival') and its description: rows that train every fold "
                                "and the head, never held out. auto (default): the folds decide, each feature set "
                                "fit with them and without; true: always; false: never.")
        group.add_argument("--folds", type=int, default=5,
                           help="pipelines.fit: folds of the stratified cross-validation that chooses the "
                                "regularisation (fewer when a label has fewer rows).")


def _labels_at_launch(options: PipelineOptions, column: str):
    """The label column of file inputs, read before any model work (None for BigQuery)."""
    o = options.view_as(StepOptions)
    if not o.input:
        return None
    paths = local_paths(o.input)
    if not paths:
        return None  # remote files: checked when the features are back
    # (a JSON line that does not parse fails as a row, as in classify: not a label)
    return [r[0] for r in local_columns(paths, input_format(options), [column]) if r is not None]


class _Shape(beam.DoFn):
    """An embedded row -> (label, text hash, features) for the staged features file."""

    def __init__(self, text_column: str, label_column: str):
        self._text, self._label = text_column, label_column

    def process(self, row):
        text = row.get(self._text)
        text = text.decode("utf-8") if isinstance(text, bytes) else str(text or "")  # (bytes that failed to decode failed)
        yield {"label": "" if row.get(self._label) is None else str(row[self._label]),
               "hash": text_hash(text), "text": text, "prompt": row["prompt_fingerprint"],
               FEATURES_COLUMN: row[FEATURES_COLUMN]}


def run(argv: list[str] | None = None, test_pipeline: beam.Pipeline | None = None) -> dict:
    """Compute the features (a Beam pipeline), fit the head, write it; returns a summary."""
    argv = join_negative_lists(list(sys.argv[1:] if argv is None else argv), ("--layers",))
    refuse_unknown_flags(argv, (StepOptions, FitOptions), invoked_as("fit"))
    options = PipelineOptions(argv)
    o, f = options.view_as(StepOptions), options.view_as(FitOptions)
    task_file = resolve_task(o.task or "support_tickets")
    extraction = fit_extraction.is_extraction(task_file)
    if extraction:
        fit_extraction.refuse_classification_flags(f)
        if not o.output or not o.input:
            raise ValueError("pipelines.fit on an extraction task needs --input (labelled JSONL rows) and --output "
                             "(the head file to write)")
    elif not o.output or not f.label_column:
        raise ValueError("pipelines.fit needs --output (the head file to write) and --label_column")
    if o.output.endswith("/") or ("://" not in o.output and os.path.isdir(o.output)):
        raise ValueError(f"--output={o.output!r} is a directory; give the head file's path, e.g. support.head")
    if f.folds < 2:
        raise ValueError(f"--folds must be >= 2, got {f.folds}")
    refuse_local_paths(options, ("output", "summary_output"))  # on Dataflow: its workers stage beside --output
    defaults = PipelineOptions([]).view_as(StepOptions)
    given = [name for name in NOT_FOR_FIT if getattr(o, name) != getattr(defaults, name)]
    if given:
        raise ValueError(f"--{given[0]} does not apply to pipelines.fit: it writes one head file (--output) "
                         f"and, with --summary_output, its summary JSON; it writes no rows")
    # no feature flag: the features are chosen by folds (pipelines.fit_search), with the
    # precision where --dtype is auto (the default)
    search = f.layers is None and f.pooling is None
    if f.prefer is not None and not search and not extraction:
        raise ValueError(f"--prefer {f.prefer} chooses among candidate features by folds, and --layers/--pooling "
                         f"name the features: give one or the other")
    f.prefer = f.prefer or "balanced"
    # (a fit makes the head: no head's precision to follow)
    dtypes, why = fit_search.precisions(o.dtype, o.device, search and not extraction)
    layers = None if search else parse_layers(f.layers or "-1")
    # the head this run writes may replace the one the task names (not read here), never
    # the input, the task file or the model
    outputs = [Output("--output", o.output)] + ([Output("--summary_output", o.summary_output)]
                                                if o.summary_output else [])
    refuse_unreachable(remote_paths(options, outputs))  # in seconds, before any check reads them
    refuse_collisions(outputs)
    refuse_overlap(outputs, run_reads(options, "fit", task_file=task_file, with_head=False))
    with contextlib.ExitStack() as held:
        hold_outputs(held, outputs)  # another fit of the same head would replace this one's
        if extraction:  # (its states are computed here, not on workers: nothing to stage)
            return fit_extraction.fit_extraction(options, task_file)
        staged = stage_for_workers(options, run_models(options, "fit", task_file=task_file))
        return _fit(options, task_file, layers, test_pipeline, staged, dtypes=dtypes, why=why)


def _fit(options: PipelineOptions, task_file: str, layers: tuple[int, ...] | None, test_pipeline,
         staged: str | None = None, *, dtypes: list[str], why: str) -> dict:
    """The fit itself, once the flags and outputs are checked and locked (`layers` None: the
    features chosen by folds, in each of `dtypes` (why: `why`); `staged`: the embedded
    model's spec for workers that lack it)."""
    o, f = options.view_as(StepOptions), options.view_as(FitOptions)
    task = task_without_head(task_file)
    found = None
    pooling = f.pooling or "last"
    if layers is None:
        from beam_prefix.model.loading import load_config

        found = feature_search.candidates(load_config(o.model or task.model or EMBEDDED).get_text_config()
                                          .num_hidden_layers)
        layers, pooling = feature_search.union(found)
    if o.bigquery_endpoint:
        bigquery_endpoint.install(bigquery_endpoint.Endpoint(rest=o.bigquery_endpoint, grpc=o.bigquery_storage_endpoint,
                                                             project=None))
    schema = input_schema(options)
    require_columns(options, schema, {"--text_column": [o.text_column], "--label_column": [f.label_column]})
    launch_labels = _labels_at_launch(options, f.label_column)
    if launch_labels is not None:
        check_labels(task, launch_labels)  # before any model work
    embeds = {d: EmbedText(task=task, layers=layers, model=staged or o.model, text_column=o.text_column,
                           id_column=o.id_column, dtype=d, threads=o.torch_threads, batch_size=o.batch_size or 16,
                           max_text_tokens=o.max_text_tokens, overflow=o.overflow, min_batch_size=o.min_batch_size,
                           max_batch_size=o.max_batch_size, verify=o.verify == "true",
                           keep_columns=[o.text_column, f.label_column], device=o.device, pooling=pooling)
              for d in dtypes}
    for embed in embeds.values():
        embed.config.check_fits()
    staging = FeatureStaging(o.output)  # on the head's own file system: workers anywhere can deliver
    staging.prepare()
    try:
        p = test_pipeline or beam.Pipeline(options=options)
        rows, unparseable = read_rows(p, options)
        staged = pa.schema([("label", pa.string()), ("hash", pa.int64()), ("text", pa.string()),
                            ("prompt", pa.string()), (FEATURES_COLUMN, pa.list_(pa.float32()))])
        if f.label_rows != "false":  # the task's own words, through the same step: the same features
            texts, names = task_label_rows(task)
            label_rows = p | "LabelRows" >> beam.Create([{o.text_column: t, f.label_column: n}
                                                          for t, n in zip(texts, names)])
        failures = [unparseable]
        for i, (d, embed) in enumerate(embeds.items()):
            at = "" if i == 0 else f" {d}"  # (the first precision's steps keep their names)
            result = rows | f"EmbedText{at}" >> embed
            _ = (result.embedded | f"Shape{at}" >> beam.ParDo(_Shape(o.text_column, f.label_column))
                 | f"WriteFeatures{at}" >> beam.io.WriteToParquet(staging.features_of(d), staged,
                                                                  file_name_suffix=".parquet"))
            if i == 0:  # (a row fails alike in every precision: its text, not its numbers)
                failures.append(result.failed)
            if f.label_rows != "false":
                extra = label_rows | f"EmbedLabelRows{at}" >> embed
                _ = (extra.embedded | f"ShapeLabelRows{at}" >> beam.ParDo(_Shape(o.text_column, f.label_column))
                     | f"WriteLabelRows{at}" >> beam.io.WriteToParquet(staging.label_rows_of(d), staged,
                                                                       file_name_suffix=".parquet"))
                # (not input rows: not counted as failed ones; a missing one is an error below)
        failed = tuple(failures) | "AllFailed" >> beam.Flatten() | "Count" >> beam.combiners.Count.Globally()
        _ = failed | "WriteFailedCount" >> beam.io.WriteToText(staging.failed)
        start = time.perf_counter()
        run_to_end(p)  # a job the runner ended unfinished leaves partial features: no head from them
        features_s = time.perf_counter() - start
        n_failed = staging.failed_count()
        by_dtype, label_rows_note, first = {}, None, None
        for d in dtypes:
            table, extra, label_rows_note = _staged(staging, d, task, f.label_rows)
            if first is None:
                first = table
            elif table.drop_columns([FEATURES_COLUMN]) != first.drop_columns([FEATURES_COLUMN]) \
                    or (extra is None) != (by_dtype[dtypes[0]][1] is None):  # (one row failed in one precision only)
                raise RuntimeError(f"the rows' features in {d} are not the same rows as in {dtypes[0]}; fit with "
                                   f"--dtype {dtypes[0]}")
            by_dtype[d] = (np.asarray(table.column(FEATURES_COLUMN).to_pylist(), dtype=np.float32), extra)
        labels = first.column("label").to_pylist()
        check_labels(task, labels)  # again: what the run actually read (BigQuery, remote files, failed rows)
        prompt = first.column("prompt")[0].as_py()
        # (the n-grams read each row's whole text; a row cut at --max_text_tokens is read cut
        # when classified)
        texts = first.column("text").to_pylist()
        hashes = first.column("hash").to_pylist()
        searched = {}
        if found is not None:
            costs = fit_search.ms_per_row(embeds[dtypes[0]].config.model, dtypes, task, texts, found)
            head, table_of, chosen = fit_search.fit_candidates(
                found, layers, by_dtype, labels, hashes, task, prompt=prompt, folds=f.folds,
                texts=texts if f.lexical == "true" else None, prefer=f.prefer, costs=costs,
                label_rows=f.label_rows, why=why)
            searched = {"candidates": table_of, "chosen": chosen}
            layers, pooling = head.layers, head.pooling
        else:
            (dtype, (features, extra)), = by_dtype.items()
            head, by_folds = fit_search.with_or_without_label_rows(
                lambda more: fit_head(features, labels, hashes, task, layers=layers,
                                      fingerprint=feature_fingerprint(prompt, precision_of(dtype), layers, pooling),
                                      folds=f.folds, pooling=pooling, texts=texts if f.lexical == "true" else None,
                                      extra=more, dtype=dtype), extra, f.label_rows)
            if by_folds is not None:
                searched = {"label_rows_fold_accuracy": by_folds}
        if label_rows_note:
            searched["label_rows_note"] = label_rows_note
    finally:
        staging.delete()
    write_head(head, o.output)  # all or nothing
    summary = {"head": o.output, "task": task.name, "rows_used": len(labels), "rows_failed": n_failed,
               "features": int(head.features), "layers": list(layers), "pooling": pooling, "dtype": head.dtype,
               "features_s": round(features_s, 2), **searched,
               "lexical_alpha": head.lexical.alpha if head.lexical is not None else 0.0,
               "label_rows": head.metrics.get("label_rows", 0),
               **{k: v for k, v in head.metrics.items() if k not in ("per_label_f1", "feature_search")},
               "worst_label_f1": sorted(head.metrics.get("per_label_f1", {}).items(), key=lambda kv: kv[1])[:5]}
    if o.summary_output:  # where a Flex Template's launcher output is not at hand
        write_json(summary, o.summary_output)
    return summary


def _staged(staging: FeatureStaging, dtype: str, task, label_rows: str):
    """One precision's staged rows, in one order whatever order the workers delivered them in
    (the folds split rows by position, so the head is the same on every runner and run),
    with the task's label rows as `fit_head_from_features` takes them (None: not used) and
    why they were not used (or None).

    Raises:
        RuntimeError: features from more than one prompt.
        ValueError: with ``--label_rows true``, label rows that failed.
    """
    table = staging.read_features(dtype)
    table = table.sort_by([("hash", "ascending"), ("text", "ascending"), ("label", "ascending")])
    prompts = set(table.column("prompt").to_pylist())
    if len(prompts) != 1:
        raise RuntimeError(f"the features came from {len(prompts)} prompts {sorted(prompts)}; expected one")
    if label_rows == "false":
        return table, None, None
    rows_of_labels = staging.read_label_rows(dtype)
    expected = len(task_label_rows(task)[0])
    staged_rows = 0 if rows_of_labels is None else rows_of_labels.num_rows
    if staged_rows != expected and label_rows == "true":
        raise ValueError(f"{expected - staged_rows} of the task's {expected} label rows failed "
                         f"(a label name or description the step refused, e.g. longer than "
                         f"--max_text_tokens with --overflow reject); fit without --label_rows or change them")
    if staged_rows != expected:  # (auto: fit without them, and say why)
        note = (f"label rows not used: {expected - staged_rows} of the task's {expected} failed "
                f"(e.g. longer than --max_text_tokens with --overflow reject)")
        _LOGGER.warning("%s", note)
        return table, None, note
    if set(rows_of_labels.column("prompt").to_pylist()) - prompts:
        raise RuntimeError("the task's label rows came from another prompt than the rows'")
    return table, (np.asarray(rows_of_labels.column(FEATURES_COLUMN).to_pylist(), dtype=np.float32),
                   rows_of_labels.column("label").to_pylist(), rows_of_labels.column("text").to_pylist(),
                   rows_of_labels.column("hash").to_pylist()), None


def main(argv: list[str] | None = None) -> int:
    """Run from the command line: 0 done, 1 the run failed, 2 bad flags or input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        parser = argparse.ArgumentParser(prog=invoked_as("fit"), description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        StepOptions._add_argparse_args(parser)
        FitOptions._add_argparse_args(parser)
        parser.print_help()
        return 0
    return in_process_main(argv, run, _format, logger=_LOGGER)


def _format(s: dict) -> str:
    if s.get("kind") == "extract":
        return fit_extraction.format_summary(s)
    lines = [fit_search.format_table(s["candidates"], s["chosen"])] if s.get("candidates") else []
    lines += [f"head written: {s['head']} (task {s['task']}, {s['features']} features from layers {s['layers']}, "
              f"{s.get('pooling', 'last')} pooling, {s.get('dtype') or 'float32'})",
              f"rows: {s['rows_used']} used, {s['rows_failed']} failed",
              f"features: {s['features_s']:.1f} s; fit: {s['fit_s']:.1f} s"]
    if s.get("kfold_accuracy") is None:  # a label with one row: nothing to hold out
        lines.append(f"no cross-validation ({s.get('note', 'too few rows per label')}); C={s.get('C')}")
    else:
        lines.append(f"{s['folds']}-fold accuracy {s['kfold_accuracy']:.1%} at C={s.get('C')}"
                     + (f", n-grams weighed {s['lexical_alpha']:g} (hidden states alone: "
                        f"{s['kfold_accuracy_hidden_states']:.1%})" if s.get("kfold_accuracy_hidden_states") is not None
                        else ""))
        lines.append("lowest per-label F1: " + ", ".join(f"{n} {v:.2f}" for n, v in s["worst_label_f1"]))
    folds = s.get("label_rows_fold_accuracy")
    if folds and None not in folds.values():
        lines.append(f"label rows (--label_rows auto): fold accuracy {folds['with']:.1%} with the task's label rows, "
                     f"{folds['without']:.1%} without; kept {'with' if s['label_rows'] else 'without'}")
    if s.get("label_rows_note"):
        lines.append(s["label_rows_note"])
    return "\n".join(lines)


def console_main() -> None:
    """The ``beam-prefix-fit`` console script: `main`, and the process ends with its status."""
    exit_process(main())


if __name__ == "__main__":
    console_main()
