"""What every pipeline of this package shares around its own steps: flags checked and
outputs staged before anything loads, the run, the summary, publication, exit statuses.

A pipeline (`pipelines.classify`, `pipelines.extract`) supplies a `compose` function that
adds its read -> step -> write graph and returns a `Plan`; `run` and `main` do the rest
the same way for all of them (`pipelines.publish` stages outputs so a failed run leaves
none; `explain` turns a runner error into one line).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from typing import Callable

import apache_beam as beam
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

from beam_prefix.beam.classify_dofn import FAILED_TAG
from beam_prefix.errors import ModelLoadError
from beam_prefix.pipelines import bigquery_endpoint
from beam_prefix.pipelines.console import explain, exit_process, run_cli
from beam_prefix.pipelines.options import ClassifyOptions, StepOptions, refuse_unknown_flags, validate
from beam_prefix.pipelines.publish import Output, Staging
from beam_prefix.model.loading import EMBEDDED
from beam_prefix.pipelines.launch_checks import (hold_outputs, refuse_overlap, refuse_table_overlap, refuse_unreachable,
                                                 remote_heads, remote_paths, run_models, run_reads)
from beam_prefix.pipelines.model_staging import stage_for_workers
from beam_prefix.pipelines.sinks import FAILED_SCHEMA, Destination, ToOutputRow, destinations, failed_output_row, write
from beam_prefix.pipelines.sources import read_rows
from beam_prefix.pipelines.summary import (CountFailures, count_rows, format_summary, summarize, write_confusion_png,
                               write_json)
from beam_prefix.pipelines.worker_watch import WorkerWatch

__all__ = ["Plan", "build", "read_run_write", "run", "main", "invoked_as", "in_process_main", "explain", "RunFailed",
           "run_to_end", "exit_process"]

_LOGGER = logging.getLogger("beam_prefix.pipelines")

# compose(p, options, main_to, failed_to, staging, summary_path) -> Plan
Compose = Callable[..., "Plan"]


@dataclasses.dataclass
class Plan:
    """What a pipeline's `compose` added to the graph, for the summary.

    Attributes:
        kind: ``"classify"`` or ``"extract"`` (what the summary counts).
        labels: the label names (classification), else empty.
    """

    task: str
    model: str
    labels: tuple[str, ...]
    outputs: dict[str, str]
    summary_path: str | None
    eval_label_column: str | None
    staging: Staging
    kind: str = "classify"
    head: str | None = None  # the trained head the task answers with (its rows are kept out of accuracy)


def _stage(options: PipelineOptions, labeled_to: Destination, failed_to: Destination, *,
           confusion: bool) -> tuple[Staging, str | None]:
    """The run's staging (file outputs written there, published at the end) and the
    summary's final path; `confusion`: the run may draw a confusion PNG beside the summary."""
    o = options.view_as(StepOptions)
    summary_path = o.summary_output
    if summary_path and summary_path.endswith(("/", os.sep)):  # a directory: the default name in it
        summary_path += f"{Output('', labeled_to.path).name if labeled_to.path else 'run'}-summary.json"
    summary_path = summary_path or (None if labeled_to.table else f"{labeled_to.path}-summary.json")
    outputs = []
    if labeled_to.path:
        outputs.append(Output("--output", labeled_to.path, f".{labeled_to.fmt}"))
    if failed_to.path:
        outputs.append(Output("--failed_output" if o.failed_output else "--output (failed rows beside it)",
                              failed_to.path, f".{failed_to.fmt}"))
    if summary_path:
        flag = "--summary_output" if o.summary_output else "--output (summary beside it)"
        outputs.append(Output(flag, summary_path))
        if confusion:
            outputs.append(Output(f"{flag} (confusion PNG beside it)", confusion_path(summary_path)))
    return Staging(outputs), summary_path


def confusion_path(summary_path: str) -> str:
    """Where the confusion-matrix PNG goes: beside the summary."""
    return summary_path.removesuffix("-summary.json").removesuffix(".json") + "-confusion.png"


def _prepare(options: PipelineOptions) -> None:
    """Checks and process-wide settings that must precede building the graph."""
    validate(options)
    o = options.view_as(StepOptions)
    if o.bigquery_endpoint:
        bigquery_endpoint.install(bigquery_endpoint.Endpoint(
            rest=o.bigquery_endpoint, grpc=o.bigquery_storage_endpoint,
            project=options.view_as(GoogleCloudOptions).project))


def build(p: beam.Pipeline, options: PipelineOptions, compose: Compose, *, default_output: str,
          failed_name: str = "failed", validate_more=None, kind: str = "classify",
          held: contextlib.ExitStack) -> Plan:
    """Check the flags, lock and stage the outputs (the locks held until `held` closes), and
    let `compose` add the pipeline's graph to `p`."""
    _prepare(options)
    if validate_more is not None:
        validate_more(options)
    labeled_to, failed_to = destinations(options, default_output=default_output, failed_name=failed_name)
    staging, summary_path = _stage(options, labeled_to, failed_to, confusion=kind == "classify")
    refuse_unreachable(remote_paths(options, staging.outputs))  # in seconds, before any check reads them
    reads = run_reads(options, kind)
    refuse_unreachable(remote_heads(reads))  # the gs:// heads the task files name, as quickly
    staging.check()  # two outputs whose files collide would silently replace or mix rows
    refuse_overlap(staging.outputs, reads)  # nor may one replace what the run reads (or the package)
    refuse_table_overlap(options)
    hold_outputs(held, staging.outputs)  # nor may another run write them at the same time
    staging.remove_stale()  # what an earlier run into these outputs left when it was killed
    staging.preflight()  # before anything loads: an unwritable output fails in one line
    try:
        o = options.view_as(StepOptions)
        given = o.model
        staged = stage_for_workers(options, run_models(options, kind))  # workers without the embedded model
        if staged:
            o.model = staged
        plan = compose(p, options, labeled_to, failed_to, staging, summary_path)
        if staged:  # (the summary names the model, not where it was staged)
            o.model, plan.model = given, EMBEDDED
        return plan
    except BaseException:
        staging.discard()
        raise


def read_run_write(p, options: PipelineOptions, step, *, step_name: str, main: str, kept, out_schema, typed: bool,
                   on_row, to: tuple[Destination, Destination], staging: Staging, label: str,
                   before=None, after=None) -> None:
    """The IO every pipeline shares: read the input, run `step` (a `ClassifyText` or
    `ExtractFields`), shape its `main` output to `out_schema` and write it, and write every
    failed row (unreadable, failed by the step, or not fitting its column) to the failed
    destination; rows read and failed are counted for the summary, and `on_row` is called
    with each row that goes out. `before`/`after`: steps on the rows before `step` and on
    its main output before shaping."""
    rows, unparseable = read_rows(p, options)
    rows = count_rows(rows, "rows_read", label="CountRowsRead")
    if before is not None:
        rows = before(rows)
    unparseable = count_rows(unparseable, "rows_read", label="CountUnparseableRows")
    result = rows | step_name >> step
    out = result[main] if after is None else after(result[main])
    shaped = out | "ToOutputRow" >> beam.ParDo(ToOutputRow(
        out_schema, kept, typed=typed, id_column=options.view_as(StepOptions).id_column,
        on_labeled=on_row)).with_outputs(FAILED_TAG, main="rows")
    failed = ((unparseable, result[FAILED_TAG], shaped[FAILED_TAG]) | "AllFailed" >> beam.Flatten()
              | "CountFailed" >> beam.ParDo(CountFailures())
              | "ToFailedRow" >> beam.Map(failed_output_row))
    main_to, failed_to = to
    write(shaped.rows, main_to.staged(staging), out_schema, options, label=label)
    write(failed, failed_to.staged(staging), FAILED_SCHEMA, options, label="Failed")


def run(argv: list[str] | None, test_pipeline: beam.Pipeline | None, *, compose: Compose, default_output: str,
        failed_name: str = "failed", validate_more=None, on_plan=None, kind: str = "classify",
        flag_classes: tuple[type, ...] = (StepOptions, ClassifyOptions)) -> dict:
    """Build and run the pipeline; return the summary (also printed and written as JSON).

    File outputs are staged and published only when the run and its summary succeed
    (`pipelines.publish`): a run that raises leaves no output files.

    Args:
        argv: command-line flags (Beam's and `StepOptions`, with the pipeline's own).
        test_pipeline: a pipeline to build into (tests); its runner and options are used.
        compose: the pipeline's graph (see the module docstring).
        default_output: the output prefix when --output is not given.
        failed_name: the failed rows' prefix beside the output (without --failed_output).
        validate_more: the pipeline's own flag checks, run with the shared ones.
        kind: ``"classify"`` (may draw a confusion PNG) or ``"extract"``.
        on_plan: called with the `Plan` once the graph is built (before it runs).
        flag_classes: the pipeline's own option classes (with Beam's, every flag it knows).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    refuse_unknown_flags(argv, flag_classes, invoked_as(kind))
    if PipelineOptions(argv).view_as(StepOptions).bigquery_endpoint:
        # worker processes import the seam as a plugin and redirect their clients too
        # (a flag, not an attribute set later: workers receive the parsed flags)
        argv.append(f"--beam_plugins={bigquery_endpoint.__name__}")
    options = PipelineOptions(argv)
    validate(options)  # before the runner is built: a runner that cannot run this is refused by name
    # before the runner is built too: Dataflow's checks its staging bucket as it is built (minutes of
    # retries offline), so an unreachable gs:// path is refused here, in seconds
    refuse_unreachable(remote_paths(options))
    p = test_pipeline or beam.Pipeline(options=options)
    with contextlib.ExitStack() as held:  # the outputs' locks, until the run has published or failed
        plan = build(p, options, compose, default_output=default_output, failed_name=failed_name,
                     validate_more=validate_more, kind=kind, held=held)
        if on_plan is not None:
            on_plan(plan)
        summary = _run_and_publish(p, plan)
    print(format_summary(summary), flush=True)
    return summary


def _run_and_publish(p: beam.Pipeline, plan: Plan) -> dict:
    """Run the built pipeline, write its summary and publish its outputs (all or nothing)."""
    _LOGGER.info("running on %s (each worker loads the model, builds the prefix cache once and "
                 "self-checks it against full re-encoding)", type(p.runner).__name__)
    try:
        start = time.perf_counter()
        result = run_to_end(p)
        wall_s = time.perf_counter() - start
        summary = summarize(result, wall_s=wall_s, labels=plan.labels, outputs=plan.outputs, model=plan.model,
                            task=plan.task, eval_label_column=plan.eval_label_column, kind=plan.kind,
                            head=plan.head)
        if plan.summary_path:
            if summary.get("evaluation") and summary["evaluation"]["rows"]:
                png = confusion_path(plan.summary_path)
                write_confusion_png(summary, plan.labels, plan.staging.path(png))
                summary["outputs"]["confusion_matrix"] = png
            summary["outputs"]["summary"] = plan.summary_path
            write_json(summary, plan.staging.path(plan.summary_path))
        plan.staging.publish()
    except BaseException:
        plan.staging.discard()  # a failed run publishes nothing and leaves no temporary files
        raise
    return summary


def _print_help(prog: str, doc: str, options) -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Beam's own flags (--runner, --project, --region, --temp_location, --setup_file, "
               "--direct_running_mode, --job_endpoint, --environment_type, ...) are accepted too.")
    for cls in options:
        cls._add_argparse_args(parser)
    parser.print_help()


class RunFailed(RuntimeError):
    """The runner reported the job as not done."""


def run_to_end(p: beam.Pipeline):
    """Run `p` and wait for it under a `WorkerWatch` (a worker dead before it connected would
    leave the run waiting forever); its result, or RunFailed when the runner ended the job
    failed, cancelled or drained (its outputs are then partial)."""
    with WorkerWatch():
        result = p.run()
        state = result.wait_until_finish()
    if state is not None and str(state).upper().endswith(("FAILED", "CANCELLED", "DRAINED")):
        raise RunFailed(f"the runner ended the job in state {state}")
    return result


def invoked_as(cli: str) -> str:
    """How this process ran the CLI ``cli`` (``classify``, ``fit``...), for its usage and error
    lines: ``python -m pipelines.classify`` from a checkout's runner, else the installed module
    ``python -m beam_prefix.pipelines.classify``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = spec.name if spec is not None and spec.name == f"pipelines.{cli}" else f"beam_prefix.pipelines.{cli}"
    return f"python -m {module}"


def main(argv: list[str] | None, run_fn, *, prog: str, doc: str, options=(StepOptions, ClassifyOptions)) -> int:
    """Run `run_fn(argv, on_plan=...)` from the command line (`console.run_cli`). Exit status:
    0 done, 1 the run failed or lost rows, 2 bad flags, input, task file or output location
    (found before the model loads), 130 Ctrl-C, 143 SIGTERM."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # Beam's option parser would show none of ours
        _print_help(prog, doc, options)
        return 0
    plan: list[Plan] = []

    def report(summary: dict) -> int:
        return 0 if summary["accounted_for"] else 1

    return run_cli(lambda: run_fn(argv, on_plan=plan.append), cli=prog.rsplit(".", 1)[-1], started=lambda: bool(plan),
                   nothing="nothing was published",
                   outputs=lambda: plan[0].outputs if plan else None, report=report)


def in_process_main(argv: list[str] | None, run_fn, report, *, logger: logging.Logger) -> int:
    """Run `run_fn(argv)` of a CLI whose work ends in this process (`pipelines.fit`,
    `pipelines.tune`) and print `report(summary)` (`console.run_cli`). Exit status: 0 done,
    1 the run failed, 2 bad flags, input or model (a ValueError or ModelLoadError, as the
    other CLIs), 130 Ctrl-C, 143 SIGTERM."""
    def done(summary) -> int:
        print(report(summary), flush=True)
        return 0

    return run_cli(lambda: run_fn(argv), cli=logger.name.rsplit(".", 1)[-1], refused=(ValueError, ModelLoadError),
                   report=done)
