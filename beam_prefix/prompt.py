"""Prompt rendering and the token-clean prefix/suffix split.

`PromptLayout.build(task, tokenizer)` renders the task once (with the tokenizer's chat
template when it has one, else a plain template) around a sentinel standing for the
row text, and cuts it into:

* ``prefix_ids``: every static token before the row text, computed once and cached;
* a per-row suffix: the rest of the row's text span, the text, and the static tail
  (e.g. ``<|im_end|>\\n<|im_start|>assistant\\n``);
* label continuations: each label's tokens followed by a terminator, for scoring.

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
from beam_prefix.task import TaskSpec

__all__ = ["PromptLayout", "EncodedText", "PROBE_TEXTS"]

_LOGGER = logging.getLogger(__name__)

_SENTINEL = "@@BEAM_PREFIX_TEXT_SLOT@@"
_LABEL_SENTINEL = "@@BEAM_PREFIX_LABEL_SLOT@@"
_PLAIN_ANSWER_LEAD = "Answer:"

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

    def __init__(self, *, tokenizer, task: TaskSpec, mode: str, head_static: str, lead: str,
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
        self.label_ids: tuple[tuple[int, ...], ...] = ()  # set by `_derive_label_ids`

    # -- construction -------------------------------------------------------------------

    @classmethod
    def build(cls, task: TaskSpec, tokenizer, *, probes: Sequence[str] = PROBE_TEXTS) -> "PromptLayout":
        """Render `task` for `tokenizer` and choose a token-clean prefix/suffix split.

        Raises:
            BoundaryError: no candidate split is token-clean on the probes, or a label
                does not tokenize cleanly after the prompt.
        """
        mode = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
        _refuse_control_strings(task, _added_token_strings(tokenizer, special_only=True))
        if mode == "chat":
            rendered = _render_chat(task, tokenizer, _SENTINEL)
            label_lead, terminator = "", _chat_terminator(task, tokenizer)
        else:
            rendered = _render_plain(task, _SENTINEL)
            label_lead, terminator = " ", "\n"
        if rendered.count(_SENTINEL) != 1:
            raise BoundaryError(
                "the chat template did not keep the row text slot exactly once; "
                "the template may be rewriting message content")
        before, after_text = rendered.split(_SENTINEL)
        specials = _added_token_strings(tokenizer)
        cut_head = _last_special_end(before, specials)
        cut_tail = _first_special_start(after_text, specials)
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
                if task.kind == "classify":
                    layout._derive_label_ids(probes[:3])
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

    def natural_ids(self, text: str) -> tuple[int, ...]:
        """The reference encoding of the whole prompt for `text` (no prefix split)."""
        return self._head_ids + self._encode_plain(self._span(text)) + self._after_ids

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

    def _with_continuation(self, text: str, cont: str) -> tuple[int, ...]:
        """Natural ids of the prompt for `text` followed by `cont` (e.g. a label)."""
        if self._after:
            return self._head_ids + self._encode_plain(self._span(text)) + self._encode_static(self._after + cont)
        return self._head_ids + self._encode_plain(self._span(text, cont))

    def _derive_label_ids(self, probes: Sequence[str]) -> None:
        """Each label's tokens as the tokenizer writes them after the prompt; the same on
        every probe, or the label boundary is not clean."""
        label_ids = []
        for name in self.task.label_names:
            cont = self.label_lead + name + self.terminator
            found = set()
            for probe in probes:
                base = self.natural_ids(probe)
                ids = self._with_continuation(probe, cont)
                found.add(ids[len(base):] if ids[:len(base)] == base else None)
            if len(found) != 1 or None in found or not next(iter(found)):
                raise BoundaryError(
                    f"label {name!r} does not tokenize cleanly after the prompt: the prompt ends "
                    f"with {(self._tail + self._after)[-20:]!r} and the label continuation "
                    f"{cont!r} merges with it; rename the label or end the prompt with a separator")
            label_ids.append(next(iter(found)))
        self.label_ids = tuple(label_ids)

    def encode(self, text: str) -> EncodedText:
        """Encode one row's text for the cached path, applying the token budget.

        Raises:
            RowError: the text is not a non-empty string, or its tokens would merge
                across the prefix boundary.
            TextTooLongError: over budget and the task's overflow policy is `reject`.
        """
        text = _clean_text(text)
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
    def prefix_text(self) -> str:
        """The cached prefix as text."""
        return self._head_static + self._lead[:self._split]

    @property
    def prefix_length(self) -> int:
        return len(self.prefix_ids)

    def max_positions(self) -> dict[str, int]:
        """The most positions one row's prompt takes, by part: ``prefix``, ``suffix`` (the
        template's static text around the row), ``text`` (the budget, `max_text_tokens`)
        and ``answer`` (the longest label continuation scored after the suffix, or an
        extraction's `max_new_tokens`)."""
        probe = "x"
        static = len(self.suffix_for(probe)) - len(self._encode_plain(probe))
        answer = (max((len(ids) for ids in self.label_ids), default=0) if self.task.kind == "classify"
                  else self.task.max_new_tokens)
        return {"prefix": self.prefix_length, "suffix": max(static, 0), "text": self.task.max_text_tokens,
                "answer": answer}

    def fingerprint(self, model_id: str) -> str:
        """A stable hash of everything that shapes the scores: exact prefix ids, the static
        suffix parts, the label continuations and the model id."""
        payload = {
            "prefix_ids": list(self.prefix_ids),
            "suffix_static": [self._lead[self._split:], self._tail, list(self._after_ids)],
            "model": model_id,
        }
        if self.task.kind == "classify":
            payload.update(labels=list(self.task.label_names), label_ids=[list(ids) for ids in self.label_ids])
        else:  # the output schema and the decoding budget shape what is generated
            payload.update(kind=self.task.kind, schema=self.task.json_schema(),
                           max_new_tokens=self.task.max_new_tokens)
        if self.task.version is not None:  # (absent otherwise: unversioned fingerprints unchanged)
            payload["version"] = self.task.version
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()
        return digest[:16]

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


def _clean_text(text) -> str:
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


def _chat_messages(task: TaskSpec, text: str) -> list[dict]:
    messages = [{"role": "system", "content": task.system_text()}]
    for example, answer in task.example_turns():
        messages.append({"role": "user", "content": task.render_suffix(example)})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": task.render_suffix(text)})
    return messages


def _apply_template(tokenizer, messages, *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception:  # templates without a system role: fold it into the first user turn
        system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
        rest[0]["content"] = system + "\n\n" + rest[0]["content"]
        return tokenizer.apply_chat_template(rest, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)


def _render_chat(task: TaskSpec, tokenizer, text: str) -> str:
    return _apply_template(tokenizer, _chat_messages(task, text), add_generation_prompt=True)


def _chat_terminator(task: TaskSpec, tokenizer) -> str:
    """What the template writes right after an assistant answer, up to its first added token."""
    messages = _chat_messages(task, "x") + [{"role": "assistant", "content": _LABEL_SENTINEL}]
    rendered = _apply_template(tokenizer, messages, add_generation_prompt=False)
    after = rendered.split(_LABEL_SENTINEL, 1)[1] if _LABEL_SENTINEL in rendered else ""
    specials = _added_token_strings(tokenizer)
    start = _first_special_start(after, specials)
    if start < len(after):
        end = start + max(len(s) for s in specials if after.startswith(s, start))
        return after[:end]
    newline = after.find("\n")
    return after[:newline + 1] if newline >= 0 else "\n"


def _render_plain(task: TaskSpec, text: str) -> str:
    blocks = [task.system_text()]
    for example, answer in task.example_turns():
        blocks.append(f"{task.render_suffix(example)}\n{_PLAIN_ANSWER_LEAD} {answer}")
    blocks.append(f"{task.render_suffix(text)}\n{_PLAIN_ANSWER_LEAD}")
    return "\n\n".join(blocks)


def _refuse_control_strings(task: TaskSpec, specials: Sequence[str]) -> None:
    """Labels, fields and examples are rendered into the prompt as static text, which the
    tokenizer parses for control tokens: one holding `<|im_end|>` would end a turn. Only
    *special* added tokens are control tokens; a non-special added token (Gemma-3's
    ``"\n"``) is read the same in static text, in a row's text and in the reference."""
    for where, text in task.static_strings():
        found = next((sp for sp in specials if sp in text), None)
        if found is not None:
            raise TaskSpecError(f"{where} contains the tokenizer's control string {found!r}, which would be "
                                f"read as a control token in the prompt; remove it")


def _added_token_strings(tokenizer, *, special_only: bool = False) -> list[str]:
    """The added tokens' strings, longest first (where a tokenizer splits text before its
    model runs); `special_only`: only the special ones (control tokens)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted({t.content for t in decoder.values() if t.content and (t.special or not special_only)},
                  key=len, reverse=True)


def _last_special_end(s: str, specials: Sequence[str]) -> int:
    end = 0
    for tok in specials:
        i = s.rfind(tok)
        if i >= 0:
            end = max(end, i + len(tok))
    return end


def _first_special_start(s: str, specials: Sequence[str]) -> int:
    start = len(s)
    for tok in specials:
        i = s.find(tok)
        if i >= 0:
            start = min(start, i)
    return start


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
