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
from pipelines.options import SAMPLE_GOLD_COLUMN, ClassifyOptions, classify_transform, validate
from pipelines.publish import Staging
from pipelines.sinks import (FAILED_SCHEMA, Destination, ToOutputRow, destinations, failed_output_row,
                             kept_columns, labeled_schema, write)
from pipelines.sources import describe_input, input_schema, read_rows
from pipelines.summary import (GOLD_KEY, CountFailures, LabelCounter, count_rows, format_summary, stash_gold,
                               summarize, write_confusion_png, write_json)

__all__ = ["build", "run", "main", "Plan", "explain", "RunFailed"]

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
    staging: Staging


def _stage(options: PipelineOptions, labeled_to: Destination, failed_to: Destination) -> tuple[Staging, str | None]:
    """The run's staging (file outputs written there, published at the end) and the summary's final path."""
    o = options.view_as(ClassifyOptions)
    summary_path = o.summary_output or (None if labeled_to.table else f"{labeled_to.path}-summary.json")
    files = {}
    if labeled_to.path:
        files["--output"] = labeled_to.path
    if failed_to.path:
        files["--failed_output" if o.failed_output else "--output (failed rows beside it)"] = failed_to.path
    if summary_path:
        files["--summary_output" if o.summary_output else "--output (summary beside it)"] = summary_path
    return Staging(files), summary_path


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
    labeled_to, failed_to = destinations(options)
    staging, summary_path = _stage(options, labeled_to, failed_to)
    staging.preflight()  # before anything loads: an unwritable output fails in one line
    try:
        return _build(p, options, labeled_to, failed_to, staging, summary_path)
    except BaseException:
        staging.discard()
        raise


def _build(p, options, labeled_to: Destination, failed_to: Destination, staging: Staging,
           summary_path: str | None) -> Plan:
    o = options.view_as(ClassifyOptions)
    schema = input_schema(options)
    kept = kept_columns(options, schema)
    # the shipped sample has gold labels: the first run reports its accuracy
    gold = o.eval_label_column or (SAMPLE_GOLD_COLUMN if not (o.input or o.input_table or o.input_query) else None)
    if gold and schema is not None and gold not in schema.names:
        raise ValueError(f"--eval_label_column={gold!r} is not an input column (input columns: {schema.names})")
    # labelled rows carry only what the output keeps (and the stashed gold label): an input
    # column named like an output column (a gold `label`) is dropped, not overwritten
    classify = classify_transform(options, keep_columns=[f.name for f in kept] + ([GOLD_KEY] if gold else []))
    task = classify.config.task
    routes = classify.routes
    task_name = task.name if routes is None else f"{len(routes.configs)} tasks from {o.task_dir} by {o.task_column}"
    labels = task.label_names if routes is None else tuple(sorted({n for _, c in routes.configs
                                                                   for n in c.task.label_names}))
    out_schema = labeled_schema(classify.config, kept)

    rows, unparseable = read_rows(p, options)
    rows = count_rows(rows, "rows_read", label="CountRowsRead")
    if gold:
        rows = stash_gold(rows, gold)
    unparseable = count_rows(unparseable, "rows_read", label="CountUnparseableRows")
    classified = rows | "ClassifyText" >> classify
    shaped = classified.labeled | "ToOutputRow" >> beam.ParDo(ToOutputRow(
        out_schema, kept, typed=schema is not None, id_column=o.id_column,
        on_labeled=LabelCounter(gold))).with_outputs(FAILED_TAG, main="rows")
    failed = ((unparseable, classified[FAILED_TAG], shaped[FAILED_TAG]) | "AllFailed" >> beam.Flatten()
              | "CountFailed" >> beam.ParDo(CountFailures())
              | "ToFailedRow" >> beam.Map(failed_output_row))
    write(shaped.rows, labeled_to.staged(staging), out_schema, options, label="Labeled")
    write(failed, failed_to.staged(staging), FAILED_SCHEMA, options, label="Failed")

    _LOGGER.info("input: %s; task %s (%d labels); model %s; labelled rows -> %s; failed rows -> %s",
                 describe_input(options), task_name, len(labels), classify.config.model,
                 labeled_to.describe(), failed_to.describe())
    return Plan(task=task_name, model=classify.config.model, labels=labels,
                outputs={"labeled": labeled_to.describe(), "failed": failed_to.describe()},
                summary_path=summary_path, eval_label_column=gold, staging=staging)


def run(argv: list[str] | None = None, test_pipeline: beam.Pipeline | None = None, *,
        on_plan=None) -> dict:
    """Build and run the pipeline; return the summary (also printed and written as JSON).

    File outputs are staged and published only when the run and its summary succeed
    (`pipelines.publish`): a run that raises leaves no output files.

    Args:
        argv: command-line flags (Beam's and `ClassifyOptions`).
        test_pipeline: a pipeline to build into (tests); its runner and options are used.
        on_plan: called with the `Plan` once the graph is built (before it runs).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if PipelineOptions(argv).view_as(ClassifyOptions).bigquery_endpoint:
        # worker processes import the seam as a plugin and redirect their clients too
        # (a flag, not an attribute set later: workers receive the parsed flags)
        argv.append(f"--beam_plugins={bigquery_endpoint.__name__}")
    options = PipelineOptions(argv)
    p = test_pipeline or beam.Pipeline(options=options)
    plan = build(p, options)
    if on_plan is not None:
        on_plan(plan)
    _LOGGER.info("running on %s (each worker loads the model, builds the prefix cache once and "
                 "self-checks it against full re-encoding)", type(p.runner).__name__)
    try:
        start = time.perf_counter()
        result = p.run()
        state = result.wait_until_finish()
        wall_s = time.perf_counter() - start
        if state is not None and str(state).upper().endswith(("FAILED", "CANCELLED", "DRAINED")):
            raise RunFailed(f"the runner ended the job in state {state}")
        summary = summarize(result, wall_s=wall_s, labels=plan.labels, outputs=plan.outputs, model=plan.model,
                            task=plan.task, eval_label_column=plan.eval_label_column)
        if plan.summary_path:
            if summary.get("evaluation") and summary["evaluation"]["rows"]:
                png = plan.summary_path.removesuffix("-summary.json").removesuffix(".json") + "-confusion.png"
                write_confusion_png(summary, plan.labels, plan.staging.path(png))
                summary["outputs"]["confusion_matrix"] = png
            summary["outputs"]["summary"] = plan.summary_path
            write_json(summary, plan.staging.path(plan.summary_path))
        plan.staging.publish()
    except BaseException:
        plan.staging.discard()  # a failed run publishes nothing and leaves no temporary files
        raise
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


class RunFailed(RuntimeError):
    """The runner reported the job as not done."""


# runner errors that have a known cause, and the one line that says it
_KNOWN_CAUSES = (
    ("Channel closed prematurely", "a worker process died (killed, or out of memory)"),
    ("MemoryError", "a worker ran out of memory"),
    ("ContextLengthError", "the task's prompt does not fit the model's context"),
    ("VerificationError", "the start-up self-check found cached scoring different from full re-encoding"),
    ("ModelLoadError", "the model could not be loaded"),
    ("PermissionError", "an output location is not writable"),
    ("No space left on device", "a disk is full"),
)


def explain(error: BaseException, outputs: dict[str, str] | None = None) -> str:
    """One line for a run that failed: the cause where it is known, the error's first line,
    and that nothing was published."""
    text = f"{type(error).__name__}: {error}"
    cause = next((why for pattern, why in _KNOWN_CAUSES if pattern in text), "the run failed")
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    where = f"; nothing was written to {', '.join(outputs.values())}" if outputs else ""
    return f"error: {cause} ({type(error).__name__}: {first[:300]}){where}"


def main(argv: list[str] | None = None) -> int:
    """Run from the command line. Exit status: 0 done, 1 the run failed or lost rows,
    2 bad flags, input, task file or output location (found before the model loads)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # Beam's option parser would show none of ours
        _print_help()
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("beam_prefix", "pipelines"):  # progress lines, not Beam's own chatter
        logging.getLogger(name).setLevel(logging.INFO)
    plan: list[Plan] = []
    try:
        summary = run(argv, on_plan=plan.append)
    except KeyboardInterrupt:
        print("error: interrupted; nothing was published", file=sys.stderr, flush=True)
        return 130
    except (ValueError, OSError) as e:
        if plan:  # found while running: a runner error, not a launch-time check
            _LOGGER.error("the runner's error:\n%s", e)
            print(explain(e, plan[0].outputs), file=sys.stderr, flush=True)
            return 1
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # noqa: BLE001 - any runner error ends in one line, the detail in the log
        _LOGGER.error("the runner's error:\n%s", e)
        print(explain(e, plan[0].outputs if plan else None), file=sys.stderr, flush=True)
        return 1
    return 0 if summary["accounted_for"] else 1


if __name__ == "__main__":
    sys.exit(main())
