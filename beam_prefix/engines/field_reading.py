"""Reading an extraction task's fields off one row's suffix states, with its trained head.

`read_fields` is what an `Extractor` with ``scoring: head`` does per row once the suffix
pass has run: the span tagger's logits on each of the row's tokens, the best valid BIO
path (`span_tags.best_path`) and its spans, each parsed as its field's type; each enum
and boolean field's head on the row's pooled states. A span that does not parse leaves
its field null, and the reason goes into the row's ``raw_output``
(``{"spans": {...}, "problems": {field: reason}}``), so the output keeps its schema.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import numpy as np
import torch

from beam_prefix.tasks.extract_task import NUMBER_LIMIT, ExtractionSpec
from beam_prefix.tasks.span_tags import SPAN_TYPES, best_path, span_value, spans_of

__all__ = ["FieldReader", "ReadFields", "read_fields", "features_identity", "pooled"]


def features_identity(task: ExtractionSpec) -> dict:
    """What the prompt fingerprint of an extraction head's features holds beyond the prompt
    and model: the same whether the task decodes or has a head, so a head fit from a
    decoding task's engine fits the head task built from it."""
    return {"kind": task.kind, "features": "suffix states"}


def pooled(states: Sequence[torch.Tensor], pooling: str) -> torch.Tensor:
    """One row's features ``[H * len(states)]`` from its suffix states ``[N, H]`` each: the
    last position's, or the mean over its positions (as `label_scorers.pool` for a batch)."""
    if pooling == "mean":
        return torch.cat([s.mean(0) for s in states], dim=-1)
    return torch.cat([s[-1] for s in states], dim=-1)


class FieldReader:
    """A task's head, ready to read rows (read-only; shared by threads).

    Args:
        task: an extraction task with ``scoring: head``.
    """

    def __init__(self, task: ExtractionSpec):
        self.task = task
        self.head = task.head
        self.layers = self.head.layers  # the order of the states a row's read gets

    def take(self, states: Sequence[torch.Tensor], layers: Sequence[int]) -> list[torch.Tensor]:
        """The states at `layers`, out of a row's states at `self.layers`."""
        return [states[self.layers.index(i)] for i in layers]


@dataclasses.dataclass(frozen=True)
class ReadFields:
    """One row's fields as its head read them.

    Attributes:
        values: every field in task order (null where no span was found or it did not parse).
        raw_output: JSON: the spans' texts, and why a span did not parse.
        logits: ``[N * T + sum(K)]`` the tagger's and field heads' logits, flattened (what
            the self-check compares with full re-encoding).
    """

    values: dict[str, Any]
    raw_output: str
    logits: torch.Tensor


def read_fields(reader: FieldReader, states: Sequence[torch.Tensor], offsets: Sequence[tuple[int, int]],
                text: str) -> ReadFields:
    """The row's fields from its suffix `states` (``[N, H]`` at `reader.layers`, on the CPU), its
    tokens' `offsets` into `text` (`PromptLayout.text_offsets`) and `text`."""
    head = reader.head
    values: dict[str, Any] = {}
    spans_read: dict[str, str] = {}
    problems: dict[str, str] = {}
    logits = []
    if head.tagger is not None:
        tagger = head.tagger
        tag_logits = tagger.logits(tagger.features(reader.take(states, tagger.layers)))
        logits.append(tag_logits.flatten())
        log_probs = torch.log_softmax(tag_logits, -1).numpy()
        is_text = np.array([start >= 0 for start, _ in offsets])
        path = best_path(log_probs, tagger.tags, is_text, tagger.transitions.numpy())
        found = spans_of(path, np.exp(log_probs), offsets, tagger.tags, text)
        for name, span in found.items():
            spans_read[name] = text[span.start:span.end]
    for field in reader.task.fields:
        if field.type in SPAN_TYPES:
            if field.name not in spans_read:
                values[field.name] = None
                continue
            value, problem = span_value(spans_read[field.name], field.type, NUMBER_LIMIT, field.max_length)
            values[field.name] = float(value) if field.type == "number" and value is not None else value
            if problem:
                problems[field.name] = problem
        else:
            field_head = head.field_heads[field.name]
            features = pooled(reader.take(states, field_head.layers), field_head.pooling)
            row_logits = field_head.logits(features[None])[0]
            logits.append(row_logits)
            label = field_head.labels[int(row_logits.argmax())]
            values[field.name] = (label == "true") if field.type == "boolean" else label
    raw = {"spans": spans_read, **({"problems": problems} if problems else {})}
    return ReadFields(values=values, raw_output=json.dumps(raw, ensure_ascii=False, separators=(",", ":")),
                      logits=torch.cat(logits) if logits else torch.zeros(0))
