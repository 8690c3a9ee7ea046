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
tagger (a multinomial logistic regression over tokens' windowed states, standardised) is
chosen among `tagger_candidates` layers and `TAGGER_C` regularisations by k-fold
cross-validation over rows, scored by entity-level micro F1 of the decoded spans
(exact span and field) on the held-out rows; each enum and boolean field's head is a
classification head (`head_fitting.fit_head_from_features`) whose layers and pooling the
same folds choose among `feature_search.candidates`. The chosen parts are refit on every
row.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from beam_prefix.engines.feature_search import candidates as head_candidates
from beam_prefix.engines.field_reading import pooled
from beam_prefix.engines.head_fitting import fit_head_from_features
from beam_prefix.model.half_precision import dtype_of, precision_name
from beam_prefix.tasks.extraction_head import ExtractionHead, SpanTagger, field_signature, window_features
from beam_prefix.tasks.span_tags import SPAN_TYPES, TagSet, best_path, spans_of, token_tags
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.tasks.trained_head import feature_fingerprint, text_hash

__all__ = ["fit_extraction_head", "labelled_rows", "LabelledRow", "tagger_candidates", "WINDOW", "TAGGER_C"]

_LOGGER = logging.getLogger(__name__)
# a token's states, and the previous and next token's (a causal state sees nothing after its
# token: the next one's says how the text goes on). Chosen on SNIPS training rows only
# (benchmarks.extraction_survey, 70 rows per intent: the best window at layers 12, 18 and 24)
WINDOW = (-1, 0, 1)
TAGGER_C = (0.1, 1.0)  # the tagger's regularisation grid (the classification heads' is wider: C_GRID)


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


def tagger_candidates(num_layers: int) -> list[tuple[int, ...]]:
    """The tagger's layer candidates for a model of `num_layers` layers: two fifths and three
    fifths down (12 and 18 of 30), one layer each (a fifth and four fifths down tagged
    SNIPS worse: docs/history.md)."""
    return sorted({(max(1, round(num_layers * f)),) for f in (0.4, 0.6)})


def fit_extraction_head(extractor, rows: Sequence[Mapping[str, Any]], *, folds: int = 5,
                        tagger_layers: Sequence[Sequence[int]] | None = None, window: Sequence[int] = WINDOW,
                        search_rows: int = 500) -> ExtractionHead:
    """A head for `extractor`'s task, prompt, model and dtype, fit on labelled `rows`.

    Args:
        extractor: an `Extractor` of the task (either scoring): its suffix pass gives the
            states the head is fit on, and will read.
        rows: labelled rows, ``{"text", "fields"}`` or ``{"text", "entities"}`` mappings
            (module docstring).
        folds: folds of the cross-validation that chooses the tagger's layer and C and each
            field head's layers and pooling (fewer when there are fewer rows).
        tagger_layers: the tagger's layer candidates (default: `tagger_candidates`).
        window: the token offsets whose states a token's features join (default `WINDOW`).
        search_rows: at most this many rows (the first, in order) choose the tagger by folds;
            the chosen one is fit on every row.

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
        tagger, tagger_metrics = _fit_tagger(
            tags, [states[i] for i in usable], [offsets[i] for i in usable], [labelled[i].spans for i in usable],
            [encoded[i].text for i in usable], every, tag_candidates, tuple(window), folds, search_rows)
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


def _token_data(tags: TagSet, states, offsets, spans, every, layers, window):
    """Per row: the tagger's token features ``[N, F]`` (numpy), gold tags and text mask."""
    out = []
    for s, o, sp in zip(states, offsets, spans):
        x = window_features([s[every.index(i)] for i in layers], window).numpy()
        out.append((x, np.array(token_tags(o, sp, tags)), np.array([a >= 0 for a, _ in o])))
    return out


def _entity_counts(tags: TagSet, log_probs, offsets, mask, spans, text: str) -> tuple[int, int, int]:
    """(true positives, predicted, gold) spans of one row, exact span and field."""
    path = best_path(log_probs, tags, mask)
    found = {(f, s.start, s.end) for f, s in spans_of(path, np.exp(log_probs), offsets, tags, text).items()}
    gold = {(f, s, e) for f, (s, e) in spans.items()}
    return len(found & gold), len(found), len(gold)


def _fit_tagger(tags: TagSet, states, offsets, spans, texts, every, candidates, window, folds, search_rows):
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import KFold

    def fit(data, c):
        x = np.concatenate([d[0][d[2]] for d in data])
        y = np.concatenate([d[1][d[2]] for d in data])
        mean, std = x.mean(0), x.std(0)
        std[std < 1e-6] = 1.0
        model = LogisticRegression(C=c, max_iter=1000).fit((x - mean) / std, y)
        return model, mean, std

    def log_probs(model, mean, std, x):
        out = np.full((len(x), tags.size), -1e9)  # a tag no training token had: never chosen
        with np.errstate(divide="ignore"):  # (a probability that underflows to 0: log -inf, never chosen)
            out[:, model.classes_] = model.predict_log_proba((x - mean) / std)
        return out

    searched = min(len(states), search_rows)
    k = min(folds, searched)
    scores: dict = {}
    if k >= 2:
        splits = list(KFold(n_splits=k, shuffle=True, random_state=0).split(np.arange(searched)))
        for layers in candidates:
            data = _token_data(tags, states[:searched], offsets[:searched], spans[:searched], every, layers, window)
            for c in TAGGER_C:
                tp = predicted = gold = 0
                for train, test in splits:
                    model, mean, std = fit([data[i] for i in train], c)
                    for i in test:
                        a, b, g = _entity_counts(tags, log_probs(model, mean, std, data[i][0]), offsets[i], data[i][2],
                                                 spans[i], texts[i])
                        tp, predicted, gold = tp + a, predicted + b, gold + g
                scores[layers, c] = 2 * tp / max(predicted + gold, 1)
                _LOGGER.info("tagger layers %s C %s: %d-fold span F1 %.4f", list(layers), c, k, scores[layers, c])
        layers, c = max(scores, key=lambda key: (scores[key], -len(key[0]), -key[0][0], -key[1]))
    else:
        layers, c = candidates[0], 1.0
    data = _token_data(tags, states, offsets, spans, every, layers, window)
    model, mean, std = fit(data, c)
    weight = np.zeros((tags.size, mean.shape[0]), dtype=np.float32)
    bias = np.full(tags.size, -1e4, dtype=np.float32)  # tags no training token had: never chosen
    coef, intercept = model.coef_, model.intercept_
    if len(model.classes_) == 2:  # sklearn's binary form: one row, the second class's logit
        coef, intercept = np.concatenate([-coef / 2, coef / 2]), np.array([-intercept[0] / 2, intercept[0] / 2])
    weight[model.classes_], bias[model.classes_] = coef, intercept
    tagger = SpanTagger(fields=tags.fields, layers=layers, window=window, weight=torch.from_numpy(weight),
                        bias=torch.from_numpy(bias), mean=torch.from_numpy(mean.astype(np.float32)),
                        std=torch.from_numpy(std.astype(np.float32)))
    metrics = {"layers": list(layers), "window": list(window), "C": c, "folds": k if k >= 2 else 0,
               "search_rows": searched, "kfold_span_f1": round(scores.get((layers, c), float("nan")), 4) if scores else None,
               "kfold_span_f1_by_candidate": {f"layers {list(l)} C {cc}": round(v, 4) for (l, cc), v in scores.items()}}
    return tagger, metrics
