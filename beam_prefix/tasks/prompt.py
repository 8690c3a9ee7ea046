"""Prompt rendering and the token-clean prefix/suffix split.

`PromptLayout.build(task, tokenizer)` renders the task once (with the tokenizer's chat
template when it has one, else a plain template) around a sentinel standing for the
row text, and cuts it into:

* ``prefix_ids``: every static token before the row text, computed once and cached;
* a per-row suffix: the rest of the row's text span, the text, and the static tail
  (e.g. ``<|im_end|>\\n<|im_start|>assistant\\n``);
* the answer format after it (`label_lead`, `terminator`), from which classification
  derives each label's tokens (`beam_prefix.tasks.labels`).

The layout knows no kind of task: a `task.PromptTask` answers what it asks (system text,
example turns, static strings); the text itself is written by `beam_prefix.tasks.prompt_render`.

The *natural* encoding of a prompt, the reference the cache must reproduce, splits only
at added (special) tokens, as a tokenizer does with the whole prompt string, except that
the row's text is never parsed for control tokens: a ticket containing ``<|im_end|>``
stays plain text in both the cached and the full path.

The split point inside the text's span (e.g. ``...user\\nTicket:`` | `` {text}``) is the
latest candidate for which encode(prefix) + encode(suffix) == encode(prefix + suffix)
on a set of probe texts, and every row is checked again when it is encoded: a row whose
tokens would merge across the boundary is rejected with a reason rather than silently
scored on a different tokenization.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import weakref
from typing import Sequence

from beam_prefix.errors import BoundaryError, RowError, TaskSpecError, TextTooLongError
from beam_prefix.tasks.prompt_render import (added_token_strings, chat_terminator, first_special_start,
                                      last_special_end, render_chat, render_plain)
from beam_prefix.tasks.task import PromptTask

__all__ = ["PromptLayout", "EncodedText", "PROBE_TEXTS", "clean_text"]

_LOGGER = logging.getLogger(__name__)

_SENTINEL = "@@BEAM_PREFIX_TEXT_SLOT@@"

# Texts used to check the boundary: letters, digits, punctuation, non-ASCII, and a
# control string that must stay plain text.
PROBE_TEXTS = (
    "I was charged twice for my subscription this month.",
    "the app crashes when I open settings",
    "1234 is my order number",
    "(urgent) can't log in!",
    "\u00e9t\u00e9 \u2014 caf\u00e9 \U0001f642",
    "'quoted' start",
    "-dash first",
    "ok",
)


@dataclasses.dataclass(frozen=True)
class EncodedText:
    """One row's text, encoded for the cached path.

    Attributes:
        suffix_ids: token ids after the cached prefix (rest of lead-in, text, tail).
        text: the text actually classified (cut when truncated).
        text_tokens: tokens of the original text (before any truncation).
        truncated: whether the text was cut to the token budget.
    """

    suffix_ids: tuple[int, ...]
    text: str
    text_tokens: int
    truncated: bool


class PromptLayout:
    """A task rendered for one tokenizer: prefix ids, suffix encoder, label continuations.

    Build it with `PromptLayout.build`; the constructor takes already computed parts.
    """

    def __init__(self, *, tokenizer, task: PromptTask, mode: str, head_static: str, lead: str,
                 split: int, tail: str, after: str, bos_ids: tuple[int, ...],
                 label_lead: str, terminator: str):
        self.tokenizer = tokenizer
        self.task = task
        self.mode = mode  # "chat" or "plain"
        self._head_static = head_static  # ends at an added token (or is empty)
        self._lead = lead  # static text between the last added token and the row text
        self._split = split  # chars of `lead` that go into the prefix
        self._tail = tail  # static text after the row text, up to the next added token
        self._after = after  # the rest of the prompt, starting at an added token
        self._bos_ids = bos_ids
        self.label_lead = label_lead
        self.terminator = terminator
        self._head_ids = self._bos_ids + self._encode_static(head_static)
        self._prefix_lead_ids = self._encode_plain(lead[:split])
        self._after_ids = self._encode_static(after)
        self.prefix_ids: tuple[int, ...] = self._head_ids + self._prefix_lead_ids

    # -- construction -------------------------------------------------------------------

    @classmethod
    def build(cls, task: PromptTask, tokenizer, *, probes: Sequence[str] = PROBE_TEXTS) -> "PromptLayout":
        """Render `task` for `tokenizer` and choose a token-clean prefix/suffix split.

        Raises:
            BoundaryError: no candidate split is token-clean on the probes, or a label
                does not tokenize cleanly after the prompt.
        """
        mode = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
        _refuse_control_strings(task, added_token_strings(tokenizer, special_only=True))
        if mode == "chat":
            rendered = render_chat(task, tokenizer, _SENTINEL)
            label_lead, terminator = "", chat_terminator(task, tokenizer)
        else:
            rendered = render_plain(task, _SENTINEL)
            label_lead, terminator = " ", "\n"
        if rendered.count(_SENTINEL) != 1:
            raise BoundaryError(
                "the chat template did not keep the row text slot exactly once; "
                "the template may be rewriting message content")
        before, after_text = rendered.split(_SENTINEL)
        specials = added_token_strings(tokenizer)
        cut_head = last_special_end(before, specials)
        cut_tail = first_special_start(after_text, specials)
        head_static, lead = before[:cut_head], before[cut_head:]
        tail, after = after_text[:cut_tail], after_text[cut_tail:]
        bos_ids = () if mode == "chat" else _bos_ids(tokenizer)

        suffix_head, _ = task.suffix_parts()
        candidates = _split_candidates(lead, suffix_head)
        if mode == "plain" and not head_static:
            candidates = [c for c in candidates if c > 0]  # nothing left to cache otherwise
        failures = []
        for split in candidates:
            layout = cls(tokenizer=tokenizer, task=task, mode=mode, head_static=head_static,
                         lead=lead, split=split, tail=tail, after=after, bos_ids=bos_ids,
                         label_lead=label_lead, terminator=terminator)
            bad = [p for p in probes if not layout._is_clean(p)]
            if not bad:
                if split != len(lead):
                    _LOGGER.info("prefix boundary moved back %d chars (%r stays in the suffix) "
                                 "to keep it token-clean", len(lead) - split, lead[split:])
                return layout
            failures.append((split, bad))
        split, bad = failures[0] if failures else (len(lead), list(probes))
        raise BoundaryError(
            f"prefix/suffix boundary is not token-clean: the prefix ends with "
            f"{(head_static + lead[:split])[-30:]!r} and the suffix starts with "
            f"{lead[split:] + '{text}'!r}; encode(prefix) + encode(suffix) != "
            f"encode(prefix + suffix) for probe text(s) {bad[:3]!r}. End the static part "
            f"with a separator the tokenizer never merges (e.g. a newline, or 'Ticket:' "
            f"before the text) or change suffix_template.")

    # -- encoding -----------------------------------------------------------------------

    def _encode_static(self, s: str) -> tuple[int, ...]:
        if not s:
            return ()
        return tuple(_tokenize(self.tokenizer, s, add_special_tokens=False).input_ids)

    def _encode_plain(self, s: str) -> tuple[int, ...]:
        """Encode text with control strings kept as plain text."""
        if not s:
            return ()
        return tuple(_tokenize(self.tokenizer, s, add_special_tokens=False, split_special_tokens=True).input_ids)

    def _span(self, text: str, continuation: str = "") -> str:
        return self._lead + text + self._tail + continuation

    def text_offsets(self, enc: EncodedText) -> list[tuple[int, int]]:
        """Each of the row's suffix tokens' character offsets into `enc.text`, leading
        whitespace left out (`span_tags.trimmed`); ``(-1, -1)`` for the template's own
        tokens. What a token-level head's spans are read back with."""
        from beam_prefix.tasks.span_tags import trimmed

        offsets = _tokenize(self.tokenizer, self._span(enc.text), add_special_tokens=False, split_special_tokens=True,
                            return_offsets_mapping=True).offset_mapping
        start, end = len(self._lead), len(self._lead) + len(enc.text)
        mine = [(a - start, b - start) if a < end and b > start else (-1, -1)
                for a, b in offsets[len(self._prefix_lead_ids):]]
        mine += [(-1, -1)] * len(self._after_ids)
        if len(mine) != len(enc.suffix_ids):  # (one tokenizer call gives both: a mismatch is a bug)
            raise RuntimeError(f"{len(mine)} offsets for {len(enc.suffix_ids)} suffix tokens of {enc.text[:40]!r}")
        return trimmed(mine, enc.text)

    def natural_ids(self, text: str) -> tuple[int, ...]:
        """The reference encoding of the whole prompt for `text` (no prefix split)."""
        return self._head_ids + self._encode_plain(self._span(text)) + self._after_ids

    def prompt_text(self, text: str) -> str:
        """The whole prompt for `text` as one string, control tokens as their text (for
        another tokenizer to encode with control strings parsed, as benchmarks do)."""
        return self._head_static + self._span(text) + self._after

    def _suffix_ids(self, text: str) -> tuple[int, ...] | None:
        """The row's suffix: its span's natural ids after the prefix's lead-in tokens, or
        None when the span's encoding does not start with them (a boundary merge)."""
        span_ids = self._encode_plain(self._span(text))
        n = len(self._prefix_lead_ids)
        if span_ids[:n] != self._prefix_lead_ids:
            return None
        return span_ids[n:] + self._after_ids

    def _is_clean(self, text: str) -> bool:
        """encode(prefix) + encode(suffix) == encode(prefix + suffix) for `text`: the
        natural encoding of the row's span starts with the prefix's tokens."""
        return self._suffix_ids(text) is not None

    def continuation_ids(self, text: str, cont: str) -> tuple[int, ...]:
        """Natural ids of the prompt for `text` followed by `cont` (e.g. a label)."""
        if self._after:
            return self._head_ids + self._encode_plain(self._span(text)) + self._encode_static(self._after + cont)
        return self._head_ids + self._encode_plain(self._span(text, cont))

    def encode(self, text: str) -> EncodedText:
        """Encode one row's text for the cached path, applying the token budget.

        Raises:
            RowError: the text is not a non-empty string, or its tokens would merge
                across the prefix boundary.
            TextTooLongError: over budget and the task's overflow policy is `reject`.
        """
        text = clean_text(text)
        budget = self.task.max_text_tokens
        text_ids = self._encode_plain(text)
        n_text = len(text_ids)
        truncated = False
        if n_text > budget:
            if self.task.overflow == "reject":
                raise TextTooLongError(
                    f"text has {n_text} tokens, over the budget of {budget} (max_text_tokens); "
                    f"overflow policy is 'reject'")
            text = self._truncate(text, budget)
            truncated = True
        suffix = self._suffix_ids(text)
        if suffix is None:
            raise RowError(
                f"the text's first characters {text[:12]!r} merge with the static prefix "
                f"{self._lead[:self._split][-12:]!r} into different tokens", reason="boundary_merge")
        return EncodedText(suffix_ids=suffix, text=text, text_tokens=n_text, truncated=truncated)

    def suffix_for(self, text: str) -> tuple[int, ...]:
        """Suffix ids of `text` as given (no cleaning or budget; used for calibration probes)."""
        suffix = self._suffix_ids(text)
        if suffix is None:
            raise BoundaryError(f"text {text!r} merges with the static prefix")
        return suffix

    def encode_full(self, text: str) -> tuple[tuple[int, ...], EncodedText]:
        """Natural ids of the whole prompt, with the same cleaning and budget as `encode`."""
        enc = self.encode(text)
        return self.natural_ids(enc.text), enc

    def _truncate(self, text: str, budget: int) -> str:
        offsets = _tokenize(self.tokenizer, text, add_special_tokens=False, split_special_tokens=True,
                                 return_offsets_mapping=True).offset_mapping
        cut = offsets[budget - 1][1]
        # Re-encoding the cut string may give a few more tokens (a split word); shrink until it fits.
        while cut > 0:
            candidate = text[:cut].rstrip()
            if len(self._encode_plain(candidate)) <= budget:
                return candidate
            cut -= 1
        raise TextTooLongError(f"text cannot be truncated to {budget} tokens")

    # -- identity -----------------------------------------------------------------------

    @property
    def prefix_length(self) -> int:
        return len(self.prefix_ids)

    def max_positions(self, answer_tokens: int) -> dict[str, int]:
        """The most positions one row's prompt takes, by part: ``prefix``, ``suffix`` (the
        template's static text around the row), ``text`` (the budget, `max_text_tokens`)
        and ``answer`` (`answer_tokens`: what follows the suffix, e.g. the longest label)."""
        probe = "x"
        static = len(self.suffix_for(probe)) - len(self._encode_plain(probe))
        return {"prefix": self.prefix_length, "suffix": max(static, 0), "text": self.task.max_text_tokens,
                "answer": answer_tokens}

    def fingerprint(self, model_id: str, answer: dict) -> str:
        """A stable hash of everything that shapes the outputs: exact prefix ids, the static
        suffix parts, the model id, and `answer` (what the engine's kind adds: the label
        continuations, or the output schema and budget)."""
        payload = {
            "prefix_ids": list(self.prefix_ids),
            "suffix_static": [self._lead[self._split:], self._tail, list(self._after_ids)],
            "model": model_id,
            **answer,
        }
        if self.task.version is not None:  # (absent otherwise: unversioned fingerprints unchanged)
            payload["version"] = self.task.version
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()
        return digest[:16]

    @property
    def ending(self) -> str:
        """The prompt's static text after the row's text (what an answer follows)."""
        return self._tail + self._after

    def describe(self) -> str:
        return (f"{self.mode} prompt, {self.prefix_length} prefix tokens, suffix = "
                f"{self._lead[self._split:] + '{text}' + self._tail + self._after!r}")


# transformers sets the Rust tokenizer's shared `encode_special_tokens` flag on every call
# that passes `split_special_tokens`, so two threads encoding with different settings (a
# prompt build next to a row's encode) can each tokenize under the other's: a row's
# "<|im_end|>" parsed as a control token, or a build's labels mixed up. One lock per
# tokenizer makes each call whole.
_TOKENIZER_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _tokenize(tokenizer, text: str, **kwargs):
    with _LOCKS_LOCK:
        lock = _TOKENIZER_LOCKS.get(tokenizer)
        if lock is None:
            lock = _TOKENIZER_LOCKS[tokenizer] = threading.Lock()
    with lock:
        return tokenizer(text, **kwargs)


def clean_text(text) -> str:
    """A row's text as the engine reads it (stripped), or the `RowError` its failed row
    carries: bytes that are not UTF-8, null, not a string, invalid Unicode, empty."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RowError(f"text is not valid UTF-8: {e}", reason="undecodable") from None
    if text is None:
        raise RowError("text is null", reason="null_text")
    if not isinstance(text, str):
        raise RowError(f"text must be a string, got {type(text).__name__}", reason="wrong_type")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a JSON "\ud800" escape
        raise RowError(f"text is not valid Unicode: {e.reason} {text[e.start:e.end]!r} at character "
                       f"{e.start}", reason="invalid_unicode") from None
    text = text.strip()
    if not text:
        raise RowError("text is empty", reason="empty_text")
    return text


def _refuse_control_strings(task: PromptTask, specials: Sequence[str]) -> None:
    """Labels, fields and examples are rendered into the prompt as static text, which the
    tokenizer parses for control tokens: one holding `<|im_end|>` would end a turn. Only
    *special* added tokens are control tokens; a non-special added token (Gemma-3's
    ``"\n"``) is read the same in static text, in a row's text and in the reference."""
    for where, text in task.static_strings():
        found = next((sp for sp in specials if sp in text), None)
        if found is not None:
            raise TaskSpecError(f"{where} contains the tokenizer's control string {found!r}, which would be "
                                f"read as a control token in the prompt; remove it")


def _bos_ids(tokenizer) -> tuple[int, ...]:
    with_special = _tokenize(tokenizer, "a", add_special_tokens=True).input_ids
    without = _tokenize(tokenizer, "a", add_special_tokens=False).input_ids
    n = len(with_special) - len(without)
    if n > 0 and with_special[n:n + len(without)] == without:
        return tuple(with_special[:n])
    return ()


def _split_candidates(lead: str, suffix_head: str) -> list[int]:
    """Split points in `lead`, latest first: all of it, without trailing whitespace, without
    the suffix template's lead-in (e.g. 'Ticket: '), and that without trailing whitespace."""
    points = [len(lead), len(lead.rstrip())]
    if suffix_head and lead.endswith(suffix_head):
        cut = len(lead) - len(suffix_head)
        points += [cut, len(lead[:cut].rstrip())]
    seen, out = set(), []
    for p in points:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out
