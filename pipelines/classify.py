"""Classify text rows from Parquet, JSONL, CSV or BigQuery; write labelled and failed rows.

    python -m pipelines.classify --runner=DirectRunner            # embedded defaults
    python -m pipelines.classify --input 'data/*.parquet' --text_column body --id_column id
    python -m pipelines.classify --input_table proj:ds.tickets --output_table proj:ds.labeled \\
        --runner=DataflowRunner --project proj --region europe-west1 --temp_location gs://b/tmp \\
        --setup_file ./setup.py --model gs://b/models/qwen2.5-0.5b-instruct

With no input it classifies the 60 sample support tickets shipped with the package,
with the shipped support-ticket task and the embedded model, into ``./output/``. Every
input row ends in exactly one of the labelled or failed outputs; the summary printed at
the end (and written beside the output as JSON) counts them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

from beam_prefix.dofn import FAILED_TAG
from pipelines import bigquery_endpoint
from pipelines.options import ClassifyOptions, classify_transform, validate
from pipelines.sinks import (FAILED_SCHEMA, ToOutputRow, destinations, failed_output_row, kept_columns,
                             labeled_schema, write)
from pipelines.sources import describe_input, input_schema, read_rows
from pipelines.summary import (CountFailures, LabelCounter, count_rows, format_summary, stash_gold,
                               summarize, write_confusion_png, write_json)

__all__ = ["build", "run", "main", "Plan"]

_LOGGER = logging.getLogger("pipelines.classify")  # also when run as __main__


@dataclasses.dataclass
class Plan:
    """What `build` added to the pipeline, for the summary."""

    task: str
    model: str
    labels: tuple[str, ...]
    outputs: dict[str, str]
    summary_path: str | None
    eval_label_column: str | None


def _prepare(options: PipelineOptions) -> None:
    """Checks and process-wide settings that must precede building the graph."""
    validate(options)
    o = options.view_as(ClassifyOptions)
    if o.bigquery_endpoint:
        bigquery_endpoint.install(bigquery_endpoint.Endpoint(
            rest=o.bigquery_endpoint, grpc=o.bigquery_storage_endpoint,
            project=options.view_as(GoogleCloudOptions).project))


def build(p: beam.Pipeline, options: PipelineOptions) -> Plan:
    """Add read -> classify -> write (labelled and failed) and the counting steps to `p`."""
    _prepare(options)
    o = options.view_as(ClassifyOptions)
    classify = classify_transform(options)
    task = classify.config.task
    schema = input_schema(options)
    kept = kept_columns(options, schema)
    out_schema = labeled_schema(classify.config, kept)
    labeled_to, failed_to = destinations(options)

    rows, unparseable = read_rows(p, options)
    rows = count_rows(rows, "rows_read", label="CountRowsRead")
    if o.eval_label_column:
        rows = stash_gold(rows, o.eval_label_column)
    unparseable = count_rows(unparseable, "rows_read", label="CountUnparseableRows")
    classified = rows | "ClassifyText" >> classify
    shaped = classified.labeled | "ToOutputRow" >> beam.ParDo(ToOutputRow(
        out_schema, kept, typed=schema is not None, id_column=o.id_column,
        on_labeled=LabelCounter(o.eval_label_column))).with_outputs(FAILED_TAG, main="rows")
    failed = ((unparseable, classified[FAILED_TAG], shaped[FAILED_TAG]) | "AllFailed" >> beam.Flatten()
              | "CountFailed" >> beam.ParDo(CountFailures())
              | "ToFailedRow" >> beam.Map(failed_output_row))
    write(shaped.rows, labeled_to, out_schema, options, label="Labeled")
    write(failed, failed_to, FAILED_SCHEMA, options, label="Failed")

    summary_path = o.summary_output or (None if labeled_to.table else f"{labeled_to.path}-summary.json")
    _LOGGER.info("input: %s; task %s (%d labels); model %s; labelled rows -> %s; failed rows -> %s",
                 describe_input(options), task.name, len(task.labels), classify.config.model,
                 labeled_to.describe(), failed_to.describe())
    return Plan(task=task.name, model=classify.config.model, labels=task.label_names,
                outputs={"labeled": labeled_to.describe(), "failed": failed_to.describe()},
                summary_path=summary_path, eval_label_column=o.eval_label_column)


def run(argv: list[str] | None = None, test_pipeline: beam.Pipeline | None = None) -> dict:
    """Build and run the pipeline; return the summary (also printed and written as JSON).

    Args:
        argv: command-line flags (Beam's and `ClassifyOptions`).
        test_pipeline: a pipeline to build into (tests); its runner and options are used.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if PipelineOptions(argv).view_as(ClassifyOptions).bigquery_endpoint:
        # worker processes import the seam as a plugin and redirect their clients too
        # (a flag, not an attribute set later: workers receive the parsed flags)
        argv.append(f"--beam_plugins={bigquery_endpoint.__name__}")
    options = PipelineOptions(argv)
    p = test_pipeline or beam.Pipeline(options=options)
    plan = build(p, options)
    _LOGGER.info("running on %s (each worker loads the model, builds the prefix cache once and "
                 "self-checks it against full re-encoding)", type(p.runner).__name__)
    start = time.perf_counter()
    result = p.run()
    result.wait_until_finish()
    wall_s = time.perf_counter() - start

    summary = summarize(result, wall_s=wall_s, labels=plan.labels, outputs=plan.outputs, model=plan.model,
                        task=plan.task, eval_label_column=plan.eval_label_column)
    if plan.summary_path:
        if summary.get("evaluation") and summary["evaluation"]["rows"]:
            png = plan.summary_path.removesuffix("-summary.json").removesuffix(".json") + "-confusion.png"
            write_confusion_png(summary, plan.labels, png)
            summary["outputs"]["confusion_matrix"] = png
        summary["outputs"]["summary"] = plan.summary_path
        write_json(summary, plan.summary_path)
    print(format_summary(summary), flush=True)
    return summary


def _print_help() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.classify", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Beam's own flags (--runner, --project, --region, --temp_location, --setup_file, "
               "--direct_running_mode, --job_endpoint, --environment_type, ...) are accepted too.")
    ClassifyOptions._add_argparse_args(parser)
    parser.print_help()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # Beam's option parser would show none of ours
        _print_help()
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("beam_prefix", "pipelines"):  # progress lines, not Beam's own chatter
        logging.getLogger(name).setLevel(logging.INFO)
    summary = run(argv)
    return 0 if summary["accounted_for"] else 1


if __name__ == "__main__":
    sys.exit(main())
