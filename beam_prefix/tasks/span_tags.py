"""Spans of a row's text as tags on its tokens, and back: what a token-level head learns.

A span field (``string``, ``number``, ``integer``, ``date``) is found by tagging each of
the row's text tokens ``O`` (outside every field), ``B-<field>`` (a span begins here) or
``I-<field>`` (it goes on): the BIO scheme. `TagSet` numbers the tags (``O`` is 0,
field k's ``B`` is ``1 + 2k`` and its ``I`` ``2 + 2k``); `token_tags` turns a row's
character spans into its tokens' tags (for fitting); `best_path` finds the most likely
tag sequence that is valid (an ``I`` only after its own field's ``B`` or ``I``; Viterbi
over the head's log-probabilities, plus learned scores for one tag following another:
`tag_transitions`); `spans_of` reads the spans back as character
offsets, at most one per field (the most probable), and `span_value` parses a span as
its field's type, or says why it does not parse.

Offsets are into the text as the engine reads it (`prompt.clean_text`: stripped); a
token's offsets leave out the whitespace it starts with (byte-level tokenizers put a
word's leading space in its token).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from typing import Mapping, Sequence

import numpy as np

__all__ = ["TagSet", "Span", "token_tags", "tag_transitions", "best_path", "spans_of", "whole_words", "span_value",
           "SPAN_TYPES", "trimmed"]

SPAN_TYPES = ("string", "number", "integer", "date")  # fields read from a span of the text
_NOT_TEXT = (-1, -1)  # a suffix token that is none of the row's text (the template's own)


@dataclasses.dataclass(frozen=True)
class TagSet:
    """The BIO tags of some span fields, numbered (see the module docstring)."""

    fields: tuple[str, ...]

    @property
    def size(self) -> int:
        return 1 + 2 * len(self.fields)

    @property
    def names(self) -> tuple[str, ...]:
        return ("O",) + tuple(f"{p}-{f}" for f in self.fields for p in "BI")

    def begin(self, field: str) -> int:
        return 1 + 2 * self.fields.index(field)

    def field_of(self, tag: int) -> str | None:
        return None if tag == 0 else self.fields[(tag - 1) // 2]

    def transitions(self) -> np.ndarray:
        """``[T, T]`` 0 where tag q may follow tag p, -inf where it may not (an ``I`` after
        anything but its own field's ``B`` or ``I``)."""
        size = self.size
        allowed = np.zeros((size, size))
        for q in range(2, size, 2):  # the I tags
            allowed[:, q] = -math.inf
            allowed[q - 1, q] = allowed[q, q] = 0.0
        return allowed


@dataclasses.dataclass(frozen=True)
class Span:
    """A field's span: character offsets into the text, and the mean probability of its tags."""

    field: str
    start: int
    end: int
    score: float


def trimmed(offsets: Sequence[tuple[int, int]], text: str) -> list[tuple[int, int]]:
    """Each token's offsets into `text`, its leading whitespace left out; ``(-1, -1)`` for a
    token that holds none of the text (or only whitespace)."""
    out = []
    for start, end in offsets:
        start, end = max(start, 0), min(end, len(text))
        while start < end and text[start].isspace():
            start += 1
        out.append((start, end) if start < end else _NOT_TEXT)
    return out


def token_tags(offsets: Sequence[tuple[int, int]], spans: Mapping[str, tuple[int, int]], tags: TagSet) -> list[int]:
    """Each token's tag, from `spans` (field -> character ``(start, end)``) and the tokens'
    `trimmed` offsets: a token overlapping a field's span is inside it (the first such
    token ``B``, the rest ``I``); every other token, and every non-text token, ``O``."""
    out, previous = [], None
    for start, end in offsets:
        inside = None
        if (start, end) != _NOT_TEXT:
            inside = next((f for f, (s, e) in spans.items() if start < e and end > s), None)
        if inside is None:
            out.append(0)
        else:
            out.append(tags.begin(inside) + (1 if inside == previous else 0))
        previous = inside
    return out


def tag_transitions(tag_rows: Sequence[np.ndarray], size: int) -> np.ndarray:
    """``[T, T]`` how much likelier tag q is after tag p than anywhere, in the training rows'
    tag sequences (each ``[N_i]``, text tokens only): ``log P(q | p) - log P(q)``, counts
    smoothed by one. Added to a path's score, it carries what one tag says of the next
    (a title's words run on; a genre rarely follows a genre), which per-token
    probabilities do not."""
    counts = np.ones((size, size))
    for tags in tag_rows:
        np.add.at(counts, (tags[:-1], tags[1:]), 1)
    following = np.log(counts / counts.sum(1, keepdims=True))
    overall = np.log(counts.sum(0) / counts.sum())
    return following - overall[None, :]


def best_path(log_probs: np.ndarray, tags: TagSet, text_tokens: np.ndarray,
              transitions: np.ndarray | None = None) -> list[int]:
    """The valid tag sequence of highest total score (Viterbi): each token's tag
    log-probability, plus ``transitions[p, q]`` wherever tag q follows tag p between two text
    tokens. `log_probs`: ``[N, T]``; `text_tokens`: ``[N]`` bool, the tokens that may be
    tagged (the others are ``O``); `transitions`: ``[T, T]`` finite scores (default none:
    every valid sequence's score is its tokens')."""
    n, size = log_probs.shape
    if n == 0:
        return []
    scores = np.where(text_tokens[:, None], log_probs, -math.inf)
    scores[:, 0] = np.where(text_tokens, log_probs[:, 0], 0.0)
    allowed = tags.transitions()
    learned = allowed if transitions is None else allowed + transitions
    start = np.where(np.arange(size) % 2 == 0, -math.inf, 0.0)
    start[0] = 0.0
    score = scores[0] + start
    back = np.zeros((n, size), dtype=np.int64)
    for i in range(1, n):
        step = score[:, None] + (learned if text_tokens[i] and text_tokens[i - 1] else allowed)
        back[i] = step.argmax(0)
        score = step.max(0) + scores[i]
    path = [int(score.argmax())]
    for i in range(n - 1, 0, -1):
        path.append(int(back[i, path[-1]]))
    return path[::-1]


def spans_of(path: Sequence[int], probs: np.ndarray, offsets: Sequence[tuple[int, int]], tags: TagSet,
             text: str) -> dict[str, Span]:
    """The spans a tag path marks, at most one per field (of several, the one whose tags
    are most probable on average): field -> `Span`. `probs`: ``[N, T]`` the tags'
    probabilities; `offsets`: the tokens' `trimmed` offsets into `text`. A span that ends
    or starts inside a word (tokenizers split numbers digit by digit, and rare words into
    pieces) is widened to the whole word's letters and digits (`whole_words`)."""
    found: dict[str, Span] = {}
    current: list | None = None  # [field, start, end, probabilities]

    def close():
        if current is not None:
            start, end = whole_words(text, current[1], current[2])
            span = Span(current[0], start, end, float(np.mean(current[3])))
            if current[0] not in found or span.score > found[current[0]].score:
                found[current[0]] = span

    for tag, (start, end), p in zip(path, offsets, probs):
        if tag == 0 or tag % 2 == 1 or current is None:
            close()
            current = None
            if tag != 0:
                current = [tags.field_of(tag), start, end, [p[tag]]]
        else:
            current[2] = end
            current[3].append(p[tag])
    close()
    return found


def whole_words(text: str, start: int, end: int) -> tuple[int, int]:
    """``(start, end)`` widened over the letters and digits the text continues with on either
    side (``4`` of ``$40`` -> ``40``; punctuation and spaces stay out)."""
    while start > 0 and text[start - 1].isalnum() and text[start].isalnum():
        start -= 1
    while end < len(text) and text[end].isalnum() and text[end - 1].isalnum():
        end += 1
    return start, end


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_DATE_FORMATS = ("%Y-%m-%d", "%d %B %Y", "%B %d %Y", "%B %d, %Y", "%d %b %Y", "%b %d %Y", "%b %d, %Y")


def span_value(text: str, field_type: str, limit: float, max_length: int = 10_000):
    """The value of a span's `text` as `field_type`, and None; or None and why it does not
    parse (the row's output then holds null for the field, and says why).

    ``string``: the text (at most `max_length` characters); ``number``/``integer``: the one
    number the span holds (``$1,250.50`` -> 1250.5; an integer field refuses a fraction),
    within `limit`; ``date``: ISO ``YYYY-MM-DD`` or a written date (``3 March 2026``)."""
    if field_type == "string":
        if len(text) > max_length:
            return None, f"span {text[:40]!r} is longer than max_length={max_length}"
        return text, None
    if field_type in ("number", "integer"):
        numbers = _NUMBER.findall(text)
        if len(numbers) != 1:
            return None, f"span {text[:40]!r} holds {len(numbers)} numbers, not one"
        value = float(numbers[0].replace(",", ""))
        if abs(value) > limit:
            return None, f"span {text[:40]!r} is beyond +-{limit:.0f}"
        if field_type == "integer":
            if not value.is_integer():
                return None, f"span {text[:40]!r} is not an integer"
            return int(value), None
        return value, None
    if field_type == "date":
        cleaned = re.sub(r"(\d)(st|nd|rd|th)\b", r"\1", text.strip())
        for fmt in _DATE_FORMATS:
            try:
                return datetime.datetime.strptime(cleaned, fmt).date().isoformat(), None
            except ValueError:
                continue
        return None, f"span {text[:40]!r} is not a date"
    raise ValueError(f"{field_type!r} is not a span field type ({SPAN_TYPES})")
