"""`pipelines.fit` on an extraction task (``kind: extract``): an extraction head from labelled rows.

    python -m beam_prefix.pipelines.fit --task ticket_fields \\
        --input pipelines/data/ticket_fields_train.jsonl --output ticket_fields.head

The input is JSONL, one labelled row per line, in either form that
`engines.extraction_fitting` reads: ``{"text", "fields": {...}}`` or
``{"text", "entities": [{"start", "end", "label"}]}``. The rows' states are computed in
this process by the task's own `Extractor` (its cached suffix pass, the one the head will
read), the head is fit (`fit_extraction_head`: the span tagger's layers, token classifier
and transition weight and each enum and boolean field's features chosen by folds) and written
all or nothing. Unlike a classification head's, the features are not computed on the
runner: a few thousand labelled rows take minutes on one machine. Classification-only
flags (``--label_column``, ``--layers``, ``--pooling``, ``--prefer``, ``--lexical``,
``--label_rows``) are refused.
"""

from __future__ import annotations

import json
import logging
import os
import time

from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from beam_prefix.engines.extraction_fitting import fit_extraction_head
from beam_prefix.engines.extractor import Extractor
from beam_prefix.model.loading import EMBEDDED
from beam_prefix.pipelines.fit_io import write_head
from beam_prefix.pipelines.options import step_dtype
from beam_prefix.pipelines.summary import write_json
from beam_prefix.tasks.extract_task import ExtractionSpec
from beam_prefix.tasks.task_file import read_task_file

__all__ = ["is_extraction", "refuse_classification_flags", "fit_extraction", "read_labelled", "format_summary"]

_LOGGER = logging.getLogger("beam_prefix.pipelines.fit")

# FitOptions flags about classification heads, and their defaults
CLASSIFICATION_ONLY = {"label_column": None, "layers": None, "pooling": None, "prefer": None, "lexical": "true",
                       "label_rows": "auto"}


def is_extraction(task_file: str) -> bool:
    """Whether the task file holds an extraction task (``kind: extract``)."""
    data = read_task_file(task_file)
    return isinstance(data, dict) and data.get("kind") == "extract"


def refuse_classification_flags(fit_options) -> None:
    """Refuse the flags that only a classification head reads, naming the first given."""
    for name, default in CLASSIFICATION_ONLY.items():
        if getattr(fit_options, name) != default:
            raise ValueError(f"--{name} is for a classification head; an extraction task's head is fit from "
                             f"labelled JSONL rows ({{'text', 'fields'}} or {{'text', 'entities'}}), its features "
                             f"chosen by folds")


def read_labelled(pattern: str) -> list[dict]:
    """The labelled rows of every file `pattern` matches (local or any Beam FileSystem), in
    file and line order.

    Raises:
        ValueError: no file matches, or a line is not a JSON object (naming file and line).
    """
    found = sorted(m.path for m in FileSystems.match([pattern])[0].metadata_list)
    if not found:
        raise ValueError(f"--input={pattern} matches no file")
    rows = []
    for path in found:
        with FileSystems.open(path) as f:
            for number, line in enumerate(f.read().decode("utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{number}: not JSON: {e}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
    return rows


def fit_extraction(options: PipelineOptions, task_file: str) -> dict:
    """Fit and write the head (flags and outputs already checked and locked); a summary."""
    from beam_prefix.pipelines.fit import FitOptions
    from beam_prefix.pipelines.options import StepOptions

    o, f = options.view_as(StepOptions), options.view_as(FitOptions)
    data = read_task_file(task_file)
    if data.get("scoring") == "head":  # the head this run writes: not read (it need not exist yet)
        data = {k: v for k, v in data.items() if k != "head"} | {"scoring": "generate"}
    task = ExtractionSpec.from_dict(data, source=f"task file {task_file!r}")
    if task.name == "task":
        task = task.replace(name=os.path.splitext(os.path.basename(task_file))[0])
    rows = read_labelled(o.input)
    start = time.perf_counter()
    extractor = Extractor.load(task, model=o.model or task.model or EMBEDDED, dtype=step_dtype(options),
                               threads=o.torch_threads, device=o.device, batch_size=o.batch_size or 16, verify=o.verify == "true")
    head = fit_extraction_head(extractor, rows, folds=f.folds)
    write_head(head, o.output)
    summary = {"head": o.output, "task": task.name, "kind": "extract", "rows_used": len(rows),
               "fit_s": round(time.perf_counter() - start, 2), **head.metrics}
    if o.summary_output:
        write_json(summary, o.summary_output)
    return summary


def format_summary(s: dict) -> str:
    """The console's lines for an extraction head's fit summary."""
    lines = [f"head written: {s['head']} (task {s['task']}, extraction; {s['rows_used']} labelled rows, "
             f"states {s['features_s']:.1f} s, fit {s['fit_s']:.1f} s)"]
    tagger = s.get("tagger")
    if tagger:
        f1 = tagger.get("kfold_span_f1")
        kind = f"C={tagger['C']}" if "C" in tagger else f"one hidden layer of {tagger.get('hidden')}"
        lines.append(f"span fields: tagger on layers {tagger['layers']}, window {tagger['window']}, {kind}, "
                     f"transitions x{tagger.get('transition_weight', 0.0)}; "
                     + (f"{tagger['folds']}-fold span F1 {f1:.3f} on {tagger['search_rows']} rows" if f1 is not None
                        else "no cross-validation (too few rows)")
                     + (f"; {s['rows_span_not_found']} rows whose span value is not in the text did not train it"
                        if s.get("rows_span_not_found") else ""))
    for name, field in (s.get("fields") or {}).items():
        acc = field.get("kfold_accuracy")
        lines.append(f"field {name}: layers {field['layers']} {field['pooling']} pooling; "
                     + (f"fold accuracy {acc:.1%}" if acc is not None else "no cross-validation"))
    return "\n".join(lines)
