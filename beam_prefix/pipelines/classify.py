"""Classify text rows from Parquet, JSONL, CSV or BigQuery; write labelled and failed rows.

    python -m beam_prefix.pipelines.classify --runner=DirectRunner            # embedded defaults
    python -m beam_prefix.pipelines.classify --input 'data/*.parquet' --text_column body --id_column id
    python -m beam_prefix.pipelines.classify --input_table proj:ds.tickets --output_table proj:ds.labeled \\
        --runner=DataflowRunner --project proj --region europe-west1 --temp_location gs://b/tmp \\
        --setup_file ./setup.py --model gs://b/models/qwen2.5-0.5b-instruct

With no input it classifies the 60 sample support tickets shipped with the package,
with the shipped support-ticket task and the embedded model, into ``./output/``. Every
input row ends in exactly one of the labelled or failed outputs; the summary printed at
the end (and written beside the output as JSON) counts them.
"""

from __future__ import annotations

import logging

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix.pipelines import launch
from beam_prefix.pipelines.launch import Plan, RunFailed, explain
from beam_prefix.pipelines.options import DEFAULT_OUTPUT, SAMPLE_GOLD_COLUMN, ClassifyOptions, StepOptions, classify_transform
from beam_prefix.pipelines.publish import Staging
from beam_prefix.pipelines.sinks import Destination, kept_columns, labeled_schema
from beam_prefix.pipelines.sources import describe_input, input_schema, require_columns
from beam_prefix.pipelines.summary import FIT_KEY, GOLD_KEY, LabelCounter, stash_gold

__all__ = ["build", "run", "main", "Plan", "explain", "RunFailed"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.classify")  # also when run as __main__


def build(p: beam.Pipeline, options: PipelineOptions) -> Plan:
    """Add read -> classify -> write (labelled and failed) and the counting steps to `p`."""
    return launch.build(p, options, _build, default_output=DEFAULT_OUTPUT["classify"])


def _build(p, options, labeled_to: Destination, failed_to: Destination, staging: Staging,
           summary_path: str | None) -> Plan:
    o, c = options.view_as(StepOptions), options.view_as(ClassifyOptions)
    schema = input_schema(options)
    kept = kept_columns(options, schema)
    # the shipped sample has gold labels: the first run reports its accuracy
    gold = c.eval_label_column or (SAMPLE_GOLD_COLUMN if not (o.input or o.input_table or o.input_query) else None)
    # before any model work: a column flag naming no column would fail every row
    require_columns(options, schema, {"--eval_label_column": [gold], "--task_column": [c.task_column]})
    # labelled rows carry only what the output keeps (and the stashed gold label): an input
    # column named like an output column (a gold `label`) is dropped, not overwritten
    probe = classify_transform(options)
    # rows a task's head was fit on are left out of the accuracy (routed: each row's own task's head)
    heads = ({None: probe.config.task.head} if probe.routes is None else
             {key: config.task.head for key, config in probe.routes.configs})
    heads = {k: h for k, h in heads.items() if h is not None} if gold else {}
    stashed = ([GOLD_KEY] if gold else []) + ([FIT_KEY] if heads else [])
    classify = classify_transform(options, keep_columns=[f.name for f in kept] + stashed)
    task = classify.config.task
    routes = classify.routes
    for config in ([classify.config] if routes is None else [c for _, c in routes.configs]):
        config.check_fits()  # a prompt too long for the model: refused now, not on workers
    task_name = task.name if routes is None else f"{len(routes.configs)} tasks from {c.task_dir} by {c.task_column}"
    labels = task.label_names if routes is None else tuple(sorted({n for _, c in routes.configs
                                                                   for n in c.task.label_names}))
    out_schema = labeled_schema(classify.config, kept)

    launch.read_run_write(p, options, classify, step_name="ClassifyText", main="labeled", kept=kept,
                          out_schema=out_schema, typed=schema is not None, on_row=LabelCounter(gold),
                          to=(labeled_to, failed_to), staging=staging, label="Labeled",
                          before=(lambda rows: stash_gold(rows, gold, heads=heads, text_column=o.text_column,
                                                          task_column=c.task_column if routes else None))
                          if gold else None)

    _LOGGER.info("input: %s; task %s (%d labels); model %s; labelled rows -> %s; failed rows -> %s",
                 describe_input(options), task_name, len(labels), classify.config.model,
                 labeled_to.describe(), failed_to.describe())
    return Plan(task=task_name, model=classify.config.model, labels=labels,
                outputs={"labeled": labeled_to.describe(), "failed": failed_to.describe()},
                summary_path=summary_path, eval_label_column=gold, staging=staging,
                head=", ".join(sorted({h.source or h.identity for h in heads.values()})) or None)


def run(argv: list[str] | None = None, test_pipeline: beam.Pipeline | None = None, *,
        on_plan=None) -> dict:
    """Build and run the pipeline; return the summary (also printed and written as JSON).
    See `pipelines.launch.run`."""
    return launch.run(argv, test_pipeline, compose=_build, default_output=DEFAULT_OUTPUT["classify"],
                      on_plan=on_plan)


def main(argv: list[str] | None = None) -> int:
    """Run from the command line (exit statuses: `pipelines.launch.main`)."""
    return launch.main(argv, run, prog=launch.invoked_as("classify"), doc=__doc__)


def console_main() -> None:
    """The ``beam-prefix-classify`` console script: `main`, and the process ends with its status."""
    launch.exit_process(main())


if __name__ == "__main__":
    console_main()
