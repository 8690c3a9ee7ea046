"""Fitting an extraction head (`ExtractionHead`) on labelled rows, inside one Python program.

    from beam_prefix import Extractor, load_task
    from beam_prefix.engines.extraction_fitting import fit_extraction_head
    ex = Extractor.load(load_task("ticket_fields"), verify=False)
    head = fit_extraction_head(ex, rows)        # rows: dicts, either form below
    head.save("ticket_fields.head")
    task = ex.task.replace(scoring="head", head=head)

A labelled row is ``{"text": ..., "fields": {name: value, ...}}`` (a span field's value
is located in the text: its first occurrence, else its first case-insensitive one) or
``{"text": ..., "entities": [{"start", "end", "label"}, ...]}`` (character spans, the form
NLU data sets use; labels are span fields' names). A row may hold both. Rows whose
span value is not in the text (or lies past a truncated text's end) do not train the
tagger (they would teach it that the value is absent), and the head's metrics count them.

The states come from the extractor's own suffix pass (`Extractor.states_encoded`: what
the head reads when it answers), once for every layer any candidate reads. The span
tagger's layers, classifier and transition weight are chosen by k-fold cross-validation
over rows, scored by entity-level micro F1 of the decoded spans (`tagger_fitting`); each enum and boolean field's head is a
classification head (`head_fitting.fit_head_from_features`) whose layers and pooling the
same folds choose among `feature_search.candidates`. The chosen parts are refit on every
row.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Mapping, Sequence

import numpy as np

from beam_prefix.engines.feature_search import candidates as head_candidates
from beam_prefix.engines.field_reading import pooled
from beam_prefix.engines.head_fitting import fit_head_from_features
from beam_prefix.engines.tagger_fitting import TAGGER_KINDS, WINDOW, fit_tagger, tagger_candidates
from beam_prefix.model.half_precision import dtype_of, precision_name
from beam_prefix.tasks.extraction_head import ExtractionHead, field_signature
from beam_prefix.tasks.span_tags import SPAN_TYPES, TagSet
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.tasks.trained_head import feature_fingerprint, text_hash

__all__ = ["fit_extraction_head", "labelled_rows", "LabelledRow"]

@dataclasses.dataclass(frozen=True)
class LabelledRow:
    """One training row: its text, its span fields' character spans, its enum and boolean
    fields' values (as labels: a boolean's ``true``/``false``), and whether its spans were
    all found (`spans_ok`)."""

    text: str
    spans: dict[str, tuple[int, int]]
    choices: dict[str, str]
    spans_ok: bool = True


def labelled_rows(task, rows: Sequence[Mapping[str, Any]]) -> list[LabelledRow]:
    """The rows in either form (module docstring), checked against the task's fields.

    Raises:
        ValueError: a row with no text, a label or field the task lacks, an enum value not
            among the field's values, or enum/boolean fields with no value in some row;
            naming the row.
    """
    fields = {f.name: f for f in task.fields}
    out = []
    for i, row in enumerate(rows):
        where = f"labelled row {i + 1}"
        text = row.get("text") if isinstance(row, Mapping) else None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: needs a non-empty 'text'")
        if "fields" not in row and "entities" not in row:
            raise ValueError(f"{where}: needs 'fields' ({{name: value}}) or 'entities' ([{{start, end, label}}])")
        spans: dict[str, tuple[int, int]] = {}
        choices: dict[str, str] = {}
        ok = True
        for entity in row.get("entities") or ():
            label = entity.get("label")
            if label not in fields or fields[label].type not in SPAN_TYPES:
                raise ValueError(f"{where}: entity label {label!r} is not one of the task's span fields "
                                 f"{[n for n, f in fields.items() if f.type in SPAN_TYPES]}")
            start, end = int(entity["start"]), int(entity["end"])
            if not 0 <= start < end <= len(text):
                raise ValueError(f"{where}: entity {label!r} spans {start}:{end}, outside the text's {len(text)} characters")
            spans.setdefault(label, (start, end))  # (a label twice in a row: its first span; a field holds one)
        given = row.get("fields") or {}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise ValueError(f"{where}: fields {unknown} are not the task's {list(fields)}")
        for name, value in given.items():
            field = fields[name]
            if field.type in SPAN_TYPES:
                if value is not None and name not in spans:
                    found = _locate(text, value)
                    if found is None:
                        ok = False
                    else:
                        spans[name] = found
            elif field.type == "boolean":
                if not isinstance(value, bool):
                    raise ValueError(f"{where}: field {name!r} is boolean, got {value!r}")
                choices[name] = "true" if value else "false"
            else:
                if value not in field.values:
                    raise ValueError(f"{where}: field {name!r} is {value!r}, not one of {list(field.values)}")
                choices[name] = value
        missing = [f.name for f in task.fields if f.type not in SPAN_TYPES and f.name not in choices]
        if missing:
            raise ValueError(f"{where}: no value for {missing} (enum and boolean fields are given under 'fields')")
        shift = len(text) - len(text.lstrip())  # the engine reads the stripped text
        out.append(LabelledRow(text=text.strip(), spans={k: (s - shift, e - shift) for k, (s, e) in spans.items()},
                               choices=choices, spans_ok=ok))
    return out


def _locate(text: str, value) -> tuple[int, int] | None:
    """Where a field's value occurs in the text: a number as any way it is written (``1250.0``
    as ``1250``, ``1,250`` or ``1,250.00``; not inside a longer number), anything else as
    written, else case-insensitively; its first occurrence."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        forms = {str(value), f"{value:.2f}", f"{value:,.2f}"}
        if float(value).is_integer():
            forms |= {str(int(value)), f"{int(value):,}"}
        found = [m for form in forms for m in [re.search(rf"(?<![\d.,]){re.escape(form)}(?![\d]|[.,]\d)", text)] if m]
        if found:
            first = min(found, key=lambda m: (m.start(), -m.end()))
            return first.start(), first.end()
        return None
    needle = str(value)
    for haystack, wanted in ((text, needle), (text.casefold(), needle.casefold())):
        at = haystack.find(wanted) if wanted else -1
        if at >= 0:
            return at, at + len(wanted)
    return None


def fit_extraction_head(extractor, rows: Sequence[Mapping[str, Any]], *, folds: int = 5,
                        tagger_layers: Sequence[Sequence[int]] | None = None, window: Sequence[int] = WINDOW,
                        search_rows: int = 500, tagger_kinds: Sequence[tuple] | None = None) -> ExtractionHead:
    """A head for `extractor`'s task, prompt, model and dtype, fit on labelled `rows`.

    Args:
        extractor: an `Extractor` of the task (either scoring): its suffix pass gives the
            states the head is fit on, and will read.
        rows: labelled rows, ``{"text", "fields"}`` or ``{"text", "entities"}`` mappings
            (module docstring).
        folds: folds of the cross-validation that chooses the tagger's layers, classifier and
            transition weight and each field head's layers and pooling (fewer when there are
            fewer rows).
        tagger_layers: the tagger's layer candidates (default: `tagger_fitting.tagger_candidates`).
        window: the token offsets whose states a token's features join (default `WINDOW`).
        search_rows: at most this many rows (the first, in order) choose the tagger by folds;
            the chosen one is fit on every row.
        tagger_kinds: the tagger's token classifiers to compare (default
            `tagger_fitting.TAGGER_KINDS`: linear, C 0.1 and 1, and one hidden layer).

    Raises:
        ValueError: a bad labelled row (`labelled_rows`), or an enum or boolean field whose
            rows all hold one value.
    """
    task = extractor.task
    labelled = labelled_rows(task, rows)
    if not labelled:
        raise ValueError("no labelled rows")
    config = extractor.model.config.get_text_config()
    span_fields = [f.name for f in task.fields if f.type in SPAN_TYPES]
    choice_fields = [f for f in task.fields if f.type not in SPAN_TYPES]
    tag_candidates = [tuple(c) for c in (tagger_layers or tagger_candidates(config.num_hidden_layers))]
    head_found = head_candidates(config.num_hidden_layers) if choice_fields else []
    every = sorted({i for c in tag_candidates for i in c} | {i for c in head_found for i in c.layers})
    start = time.perf_counter()
    encoded = [extractor.encode(r.text) for r in labelled]
    states = extractor.states_encoded(encoded, every)
    metrics: dict = {"train_rows": len(labelled), "features_s": round(time.perf_counter() - start, 2)}
    precision = precision_name(extractor.model)
    fingerprint = extractor.features_fingerprint

    tagger = None
    if span_fields:
        offsets = [extractor.layout.text_offsets(e) for e in encoded]
        usable = [i for i, r in enumerate(labelled) if r.spans_ok and all(e <= len(encoded[i].text) for _, e in r.spans.values())]
        metrics["rows_span_not_found"] = len(labelled) - len(usable)
        tags = TagSet(tuple(span_fields))
        tagger, tagger_metrics = fit_tagger(
            tags, [states[i] for i in usable], [offsets[i] for i in usable], [labelled[i].spans for i in usable],
            [encoded[i].text for i in usable], every, tag_candidates, window=tuple(window), folds=folds,
            search_rows=search_rows, kinds=tagger_kinds or TAGGER_KINDS)
        metrics["tagger"] = tagger_metrics
    field_heads = {}
    pooled_by = {c: np.stack([pooled([s[every.index(i)] for i in c.layers], c.pooling).numpy() for s in states])
                 for c in head_found}  # (once per candidate, whichever fields read it)
    for field in choice_fields:
        y = [r.choices[field.name] for r in labelled]
        values = ["false", "true"] if field.type == "boolean" else list(field.values)
        seen = set(y)
        labels = [v for v in values if v in seen]  # a value no row has: the head cannot answer it
        if len(labels) < 2:
            raise ValueError(f"field {field.name!r}: every labelled row has the value {y[0]!r}; a head learns to "
                             f"choose between two values at least (add rows with others)")
        spec = TaskSpec(instructions="", labels=labels, name=f"{task.name}.{field.name}")
        best = None
        for c in head_found:
            head = fit_head_from_features(pooled_by[c], y, [text_hash(r.text) for r in labelled], spec, layers=c.layers,
                                          fingerprint=feature_fingerprint(fingerprint, precision, c.layers, c.pooling),
                                          folds=folds, pooling=c.pooling, dtype=dtype_of(precision))
            score = head.metrics.get("kfold_accuracy") or 0.0
            if best is None or score > best[0]:
                best = (score, head)
        field_heads[field.name] = best[1]
        metrics.setdefault("fields", {})[field.name] = {"layers": list(best[1].layers), "pooling": best[1].pooling,
                                                         "kfold_accuracy": best[1].metrics.get("kfold_accuracy"),
                                                         "values_without_rows": [v for v in values if v not in labels]}
    metrics["fit_s"] = round(time.perf_counter() - start, 2)
    return ExtractionHead(fields=field_signature(task.fields), tagger=tagger, field_heads=field_heads,
                          fingerprint=fingerprint, train_hashes=[text_hash(r.text) for r in labelled],
                          metrics=metrics, dtype=dtype_of(precision))
