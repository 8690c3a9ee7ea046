"""Extract typed fields from text rows in Parquet, JSONL, CSV or BigQuery; write extracted and failed rows.

    python -m beam_prefix.pipelines.extract --runner=DirectRunner        # the sample tickets, shipped ticket_fields task
    python -m beam_prefix.pipelines.extract --input 'data/*.parquet' --task my_fields.yaml --text_column body --id_column id
    python -m beam_prefix.pipelines.extract --input_table proj:ds.tickets --output_table proj:ds.fields \\
        --runner=DataflowRunner --project proj --region europe-west1 --temp_location gs://b/tmp \\
        --setup_file ./setup.py

The input and output flags are those of `pipelines.classify` (one options and IO layer);
the task is an extraction task (``kind: extract``), and ``--max_new_tokens`` overrides its
output budget. Flags that only classification has (labels, calibration, routing) are
refused. Extracted rows are the kept input columns, one typed column per field (dates as
DATE), ``raw_output``, ``truncated``, ``prompt_fingerprint`` and ``model``; every input row
ends in exactly one of the extracted or failed outputs, and the summary counts them.
"""

from __future__ import annotations

import argparse
import datetime
import logging

import apache_beam as beam
import pyarrow as pa
from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix.tasks.extract_task import ExtractionSpec, load_task
from beam_prefix.beam.extract_transform import ExtractConfig, ExtractFields
from beam_prefix.pipelines import launch
from beam_prefix.pipelines.launch import Plan, RunFailed, explain
from beam_prefix.pipelines.options import DEFAULT_OUTPUT, DEFAULT_TASKS, ClassifyOptions, StepOptions, step_dtype
from beam_prefix.pipelines.publish import Staging
from beam_prefix.pipelines.sinks import Destination, kept_columns
from beam_prefix.pipelines.sources import describe_input, input_schema
from beam_prefix.pipelines.summary import RowCounter

__all__ = ["ExtractOptions", "build", "run", "main", "extracted_schema", "Plan", "explain", "RunFailed"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.extract")  # also when run as __main__

# failed rows beside the output (without --failed_output): not `failed`, which a
# classification run into the same directory writes
FAILED_NAME = "failed_extract"
_ARROW_TYPES = {"string": pa.string(), "enum": pa.string(), "date": pa.date32(), "integer": pa.int64(),
                "number": pa.float64(), "boolean": pa.bool_()}


class ExtractOptions(PipelineOptions):
    """Flags of the extract pipeline beyond the shared ones (`StepOptions`)."""

    @classmethod
    def _add_argparse_args(cls, parser):
        group = parser.add_argument_group("extraction")
        group.add_argument("--max_new_tokens", type=int, default=None,
                           help="pipelines.extract: the most tokens generated per row (default: the task's); a "
                                "row whose output has not closed by then fails with reason max_new_tokens.")


def _validate(options: PipelineOptions) -> None:
    classification = options.view_as(ClassifyOptions)  # flags that mean nothing to extraction
    given = [f"--{flag}" for flag in _flags(ClassifyOptions) if getattr(classification, flag) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: classification flags; pipelines.extract does not take them")
    budget = options.view_as(ExtractOptions).max_new_tokens
    if budget is not None and budget < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {budget}")


def _flags(options_class) -> list[str]:
    """The flags (dests) an options class declares."""
    parser = argparse.ArgumentParser()
    options_class._add_argparse_args(parser)
    return [a.dest for a in parser._actions if a.dest != "help"]


def extraction_task(options: PipelineOptions) -> ExtractionSpec:
    """The task `--task` names (default: the shipped ticket_fields), which must be an extraction task."""
    o = options.view_as(StepOptions)
    task = load_task(o.task or DEFAULT_TASKS["extract"])
    if not isinstance(task, ExtractionSpec):
        raise ValueError(f"--task={o.task!r} is a classification task; pipelines.extract needs a task with "
                         f"kind: extract (run pipelines.classify for this one)")
    return task


def extract_transform(options: PipelineOptions, task: ExtractionSpec, keep_columns=None) -> ExtractFields:
    """The `ExtractFields` the flags describe, for `task` (read in the launcher)."""
    o = options.view_as(StepOptions)
    return ExtractFields(task=task, model=o.model, text_column=o.text_column, id_column=o.id_column,
                         dtype=step_dtype(options) or "float32", threads=o.torch_threads, min_batch_size=o.min_batch_size, max_batch_size=o.max_batch_size,
                         batch_size=o.batch_size or 64, max_text_tokens=o.max_text_tokens, overflow=o.overflow,
                         max_new_tokens=options.view_as(ExtractOptions).max_new_tokens, verify=o.verify == "true",
                         keep_columns=keep_columns, device=o.device)


def extracted_schema(config, kept: list[pa.Field]) -> pa.Schema:
    """Arrow schema of the extracted output: the kept columns, one typed column per field
    (required fields non-nullable), then the run's columns."""
    fields = [pa.field(f.name, _ARROW_TYPES[f.type], nullable=f.nullable) for f in config.task.fields]
    added = {"raw_output": pa.string(), "truncated": pa.bool_(), "task_version": pa.string(),
             "prompt_fingerprint": pa.string(), "model": pa.string()}
    return pa.schema(list(kept) + fields + [pa.field(n, added[n]) for n in config.output_columns[len(fields):]])


class _Dates:
    """ISO date strings of the task's date fields -> `datetime.date` (Parquet DATE, BigQuery DATE)."""

    def __init__(self, names: list[str]):
        self._names = names

    def __call__(self, row: dict) -> dict:
        for name in self._names:
            if row.get(name) is not None:
                row = {**row, name: datetime.date.fromisoformat(row[name])}
        return row


def _build(p, options, extracted_to: Destination, failed_to: Destination, staging: Staging,
           summary_path: str | None) -> Plan:
    schema = input_schema(options)
    task = extraction_task(options)
    kept = kept_columns(options, schema, reserved=ExtractConfig(task=task).output_columns)
    extract = extract_transform(options, task, keep_columns=[f.name for f in kept])
    config = extract.config
    config.check_fits()  # a prompt too long for the model: refused now, not on workers
    out_schema = extracted_schema(config, kept)

    dates = _Dates([f.name for f in config.task.fields if f.type == "date"])
    launch.read_run_write(p, options, extract, step_name="ExtractFields", main="extracted", kept=kept,
                          out_schema=out_schema, typed=schema is not None, on_row=RowCounter("extracted"),
                          to=(extracted_to, failed_to), staging=staging, label="Extracted",
                          after=lambda rows: rows | "FieldDates" >> beam.Map(dates))

    _LOGGER.info("input: %s; task %s (%d fields); model %s; extracted rows -> %s; failed rows -> %s",
                 describe_input(options), config.task.name, len(config.task.fields), config.model,
                 extracted_to.describe(), failed_to.describe())
    return Plan(task=config.task.name, model=config.model, labels=(),
                outputs={"extracted": extracted_to.describe(), "failed": failed_to.describe()},
                summary_path=summary_path, eval_label_column=None, staging=staging, kind="extract")


def build(p: beam.Pipeline, options: PipelineOptions) -> Plan:
    """Add read -> extract -> write (extracted and failed) and the counting steps to `p`."""
    return launch.build(p, options, _build, default_output=DEFAULT_OUTPUT["extract"], failed_name=FAILED_NAME,
                        validate_more=_validate, kind="extract")


def run(argv: list[str] | None = None, test_pipeline: beam.Pipeline | None = None, *, on_plan=None) -> dict:
    """Build and run the pipeline; return the summary (also printed and written as JSON)."""
    return launch.run(argv, test_pipeline, compose=_build, default_output=DEFAULT_OUTPUT["extract"],
                      failed_name=FAILED_NAME, validate_more=_validate, on_plan=on_plan, kind="extract",
                      flag_classes=(StepOptions, ClassifyOptions, ExtractOptions))  # (classify's refused by name)


def main(argv: list[str] | None = None) -> int:
    """Run from the command line (exit statuses: `pipelines.launch.main`)."""
    return launch.main(argv, run, prog=launch.invoked_as("extract"), doc=__doc__,
                       options=(StepOptions, ExtractOptions))


def console_main() -> None:
    """The ``beam-prefix-extract`` console script: `main`, and the process ends with its status."""
    launch.exit_process(main())


if __name__ == "__main__":
    console_main()
