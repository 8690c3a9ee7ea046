"""The classification task: instructions, labels, few-shot examples, suffix template.

A `TaskSpec` is configuration (a frozen dataclass validated at construction); it knows
nothing about tokenizers or models (a ``scoring: head`` task holds its trained head's
weights, read with the task). `TaskSpec.from_yaml` reads a task file through
`beam_prefix.tasks.task_file` (bounded, safe); every problem is a `TaskSpecError` that names the
field and the fix.

Task file format::

    instructions: |
      Route the support ticket to one team.
    labels:                      # strings, or mappings with name/description
      - name: billing
        description: charges, refunds, invoices
      - technical
    examples:                    # optional few-shot examples
      - {text: "I was charged twice", label: billing}
    suffix_template: "Ticket: {text}"   # exactly one {text} slot
    model: embedded              # optional default model
    calibration: true            # optional: true, false, or a list of content-free texts
    max_text_tokens: 256         # optional token budget for one row's text
    overflow: truncate           # truncate (recorded) or reject
    scoring: auto                # auto, first_token or sequence
    label_search: auto           # sequence scoring: auto, pruned (exact to label_tolerance) or exhaustive
    label_tolerance: 1.0e-5      # pruned search stops when unexplored mass < this x resolved mass
    # or, with a head fit on labelled rows (python -m beam_prefix.pipelines.fit):
    scoring: head
    head: support_tickets.head   # relative to the task file
"""

from __future__ import annotations

import dataclasses
import os
import string
from typing import Any, Mapping, Sequence

from beam_prefix.errors import TaskSpecError
from beam_prefix.tasks.shipped import resolve_task
from beam_prefix.tasks.task_file import (MAX_TASK_FILE_BYTES, _cut, nesting_depth, read_task_file, refuse_invisible,
                                        refuse_lookalikes)

__all__ = ["Label", "Example", "TaskSpec", "PromptTask", "read_task_file", "validate_common", "suffix_parts", "nesting_depth", "DEFAULT_CALIBRATION_TEXTS", "MAX_TASK_FILE_BYTES"]

_MAX_NAME_CHARS = 200

DEFAULT_CALIBRATION_TEXTS = ("N/A", "", "[MASK]")
_OVERFLOW_POLICIES = ("truncate", "reject")
_SCORING_MODES = ("auto", "first_token", "sequence", "head")
LABEL_SEARCHES = ("auto", "pruned", "exhaustive")
_KNOWN_KEYS = {
    "name", "instructions", "labels", "examples", "suffix_template", "model",
    "calibration", "max_text_tokens", "overflow", "scoring", "label_search", "label_tolerance", "version", "kind",
    "head",
}


@dataclasses.dataclass(frozen=True)
class Label:
    """One class: `name` is what the model is asked to answer, `description` helps it."""

    name: str
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise TaskSpecError(f"labels: every label needs a non-empty string name, got {_short(self.name)}")
        if self.name != self.name.strip():
            raise TaskSpecError(f"labels: label {_short(self.name)} has leading/trailing whitespace; remove it")
        if "\n" in self.name:
            raise TaskSpecError(f"labels: label {_short(self.name)} contains a newline")
        refuse_invisible(self.name, "labels: label")
        if not isinstance(self.description, str):
            raise TaskSpecError(f"labels: description of {_short(self.name)} must be a string")


@dataclasses.dataclass(frozen=True)
class Example:
    """A few-shot example: a text and its label (which must be one of the task's labels)."""

    text: str
    label: str

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise TaskSpecError(f"examples: every example needs a non-empty text, got {_short(self.text)}")
        if not isinstance(self.label, str):
            raise TaskSpecError(f"examples: label of example {self.text[:40]!r} must be a string")


class PromptTask:
    """What every kind of task shares: the suffix template's parts, `replace`, and reading
    from a parsed mapping with the known keys checked (each kind adds its own fields)."""

    kind = "classify"
    suffix_template: str

    def render_suffix(self, text: str) -> str:
        """The suffix template with `text` in its slot (no `str.format` on user text)."""
        head, tail = self.suffix_parts()
        return head + text + tail

    def suffix_parts(self) -> tuple[str, str]:
        """The literal text before and after the `{text}` slot."""
        return suffix_parts(self.suffix_template)

    def replace(self, **changes: Any):
        """A copy with some fields changed (e.g. `task.replace(calibration=True)`)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def _from_mapping(cls, data: Any, source: str, known: set, required: str, missing: str,
                      lists: Sequence[str]):
        """`cls(**data)` after the checks every kind makes; `lists`: fields where null means empty."""
        if not isinstance(data, Mapping):
            raise TaskSpecError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise TaskSpecError(f"{source}: unknown field(s) {unknown} for kind {cls.kind}; known fields are "
                                f"{sorted(known)}")
        if required not in data:
            raise TaskSpecError(f"{source}: no {required!r} field; {missing}")
        kwargs = {k: v for k, v in data.items() if k != "kind"}
        kwargs["instructions"] = kwargs.get("instructions") or ""
        for name in lists:
            kwargs[name] = kwargs.get(name) or ()
        try:
            return cls(**kwargs)
        except TaskSpecError as e:
            raise TaskSpecError(f"{source}: {e}") from None


@dataclasses.dataclass(frozen=True)
class TaskSpec(PromptTask):
    """A classification task, independent of any model.

    Args:
        instructions: the static instructions (system message in chat models).
        labels: the classes, in output order.
        examples: few-shot examples, rendered as static conversation turns.
        suffix_template: the per-row text, with exactly one `{text}` slot.
        name: a short name used in logs.
        model: optional default model for this task (`embedded`, a hub id, a path).
        calibration: contextual calibration texts scored once at start-up (empty: off).
        max_text_tokens: token budget for one row's text.
        overflow: `truncate` (keep the first `max_text_tokens` tokens, recorded in the
            prediction) or `reject` (the row fails with reason `too_long`).
        scoring: `first_token`, `sequence`, or `auto` (first token when the labels'
            first tokens are distinct, else full label sequence).
        label_search: in sequence scoring, `pruned` (best-first over the label trie,
            `beam_prefix.engines.label_search`), `exhaustive` (every trie token for every row), or
            `auto` (default): pruned under shared-prefix attention, exhaustive on the
            expanded working cache, where every round of a pruned search would copy the
            batch-expanded prefix again.
        label_tolerance: pruned search stops for a row when the probability mass it has
            not explored is below this fraction of the mass of the labels it resolved.
        version: optional version of the prompt, in the fingerprint and on every output
            row (``task_version``), so a changed prompt is visible downstream.
        head: with ``scoring: head``, the trained head (`trained_head.TrainedHead`, or the
            path of its file, read here; in a task file relative to the file): labels are
            scored by it instead of by the language model's label tokens.
    """

    instructions: str
    labels: tuple[Label, ...]
    examples: tuple[Example, ...] = ()
    suffix_template: str = "Ticket: {text}"
    name: str = "task"
    model: str | None = None
    calibration: tuple[str, ...] = ()
    max_text_tokens: int = 256
    overflow: str = "truncate"
    scoring: str = "auto"
    label_search: str = "auto"
    label_tolerance: float = 1e-5
    version: str | None = None
    head: Any = None

    def __post_init__(self):
        labels = tuple(_coerce_label(label) for label in _as_sequence(self.labels, "labels"))
        object.__setattr__(self, "labels", labels)
        examples = tuple(_coerce_example(e) for e in _as_sequence(self.examples, "examples"))
        object.__setattr__(self, "examples", examples)
        calibration = self.calibration
        if calibration is True:
            calibration = DEFAULT_CALIBRATION_TEXTS
        elif calibration in (False, None):
            calibration = ()
        calibration = tuple(_as_sequence(calibration, "calibration"))
        if not all(isinstance(c, str) for c in calibration):
            raise TaskSpecError("calibration: expected true/false or a list of strings")
        object.__setattr__(self, "calibration", calibration)
        self._validate()

    def _validate(self) -> None:
        validate_common(self)
        if not self.labels:
            raise TaskSpecError("labels: a task needs at least two labels, got none")
        if len(self.labels) < 2:
            raise TaskSpecError(f"labels: a task needs at least two labels, got {self.label_names}")
        refuse_lookalikes(self.label_names, "labels: labels")
        seen: set[str] = set()
        for name in self.label_names:
            if name in seen:
                raise TaskSpecError(f"labels: duplicate label {name!r}; each label must appear once")
            seen.add(name)
        for example in self.examples:
            if example.label not in seen:
                raise TaskSpecError(
                    f"examples: example {example.text[:40]!r} has label {example.label!r}, "
                    f"which is not one of {list(self.label_names)}"
                )
        if self.scoring not in _SCORING_MODES:
            raise TaskSpecError(f"scoring: expected one of {_SCORING_MODES}, got {self.scoring!r}")
        if self.label_search not in LABEL_SEARCHES:
            raise TaskSpecError(f"label_search: expected one of {LABEL_SEARCHES}, got {self.label_search!r}")
        tol = self.label_tolerance
        if isinstance(tol, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
            try:
                tol = float(tol)
            except ValueError:
                pass
            else:
                object.__setattr__(self, "label_tolerance", tol)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
            raise TaskSpecError(f"label_tolerance: expected a number between 0 and 1 (exclusive), got {tol!r}")
        self._validate_head()

    def _validate_head(self) -> None:
        """``scoring: head`` needs a head for exactly these labels, and no calibration (the
        head's probabilities are its own); a head needs ``scoring: head``."""
        if self.head is None:
            if self.scoring == "head":
                raise TaskSpecError("scoring: head needs a head (head: FILE; fit one with python -m beam_prefix.pipelines.fit)")
            return
        if self.scoring != "head":
            raise TaskSpecError(f"head: a trained head is used with scoring: head, not {self.scoring!r}")
        if self.calibration:
            raise TaskSpecError("calibration does not apply to a trained head (its probabilities are fit on "
                                "labelled rows): remove calibration, or use scoring: auto")
        from beam_prefix.tasks.trained_head import TrainedHead

        if isinstance(self.head, (str, os.PathLike)):
            object.__setattr__(self, "head", TrainedHead.load(self.head))
        if not isinstance(self.head, TrainedHead):
            raise TaskSpecError(f"head: expected a head file path, got {type(self.head).__name__}")
        if self.head.labels != self.label_names:
            raise TaskSpecError(f"head {self.head.source or self.head.identity} was fit for labels "
                                f"{list(self.head.labels)[:6]}... ({len(self.head.labels)}), the task has "
                                f"{list(self.label_names)[:6]}... ({len(self.label_names)})")

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(label.name for label in self.labels)

    # -- what the prompt renders (`prompt.PromptLayout` asks every kind of task the same) --

    def system_text(self) -> str:
        """The static instructions block: instructions, the labels, the answer format."""
        lines = [f"- {label.name}: {label.description}" if label.description else f"- {label.name}"
                 for label in self.labels]
        parts = [self.instructions.strip(), "Labels:\n" + "\n".join(lines),
                 "Answer with exactly one label name and nothing else."]
        return "\n\n".join(p for p in parts if p)

    def example_turns(self) -> tuple[tuple[str, str], ...]:
        """Few-shot turns as (row text, answer)."""
        return tuple((e.text, e.label) for e in self.examples)

    def static_strings(self) -> list[tuple[str, str]]:
        """(where, text) of everything the task file puts into the prompt as static text."""
        out = [(f"labels: label {label.name[:60]!r}", label.name) for label in self.labels]
        out += [(f"labels: description of {label.name[:60]!r}", label.description) for label in self.labels]
        out += [(f"examples: example {e.text[:40]!r}", e.text + "\n" + e.label) for e in self.examples]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "task", base_dir: str | None = None) -> "TaskSpec":
        """Build a task from a parsed mapping (the YAML document); a relative `head` path is
        read from `base_dir` (the task file's directory)."""
        if isinstance(data, Mapping) and isinstance(data.get("head"), str) and base_dir \
                and "://" not in data["head"]:  # (gs://: as written)
            data = {**data, "head": confined_head(data["head"], base_dir, source)}
        if isinstance(data, Mapping) and data.get("kind", cls.kind) != cls.kind:
            raise TaskSpecError(f"{source}: kind {_short(data.get('kind'))} is not a classification task; "
                                f"read it with beam_prefix.load_task")
        return cls._from_mapping(data, source, _KNOWN_KEYS, "labels", "a task needs at least two labels",
                                 ("examples", "labels"))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, *, data: Any = None) -> "TaskSpec":
        """Read a task file (YAML, safe-loaded), or a shipped task by its name
        (``"support_tickets"``: `shipped.resolve_task`). ``data``: its parsed document, where
        the caller has read it already (`task_file.read_task_file`), so that one reading serves all."""
        path = resolve_task(path)
        spec = cls.from_dict(read_task_file(path) if data is None else data, source=f"task file {path!r}",
                             base_dir=os.path.dirname(os.path.abspath(path)))
        if spec.name == "task":
            spec = spec.replace(name=os.path.splitext(os.path.basename(path))[0])
        return spec


def confined_head(head: str, base_dir: str, source: str) -> str:
    """A task file's local `head` path, read relative to the task file's directory
    `base_dir` and confined to it (or a folder below it), symbolic links resolved: a task
    file names its own head, never ``../../etc/passwd``.

    Raises:
        TaskSpecError: a head outside the task file's directory, naming both.
    """
    path = os.path.join(base_dir, head)  # (an absolute head stays as given)
    root = os.path.realpath(base_dir)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise TaskSpecError(f"{source}: head: {head!r} is outside the task file's directory {base_dir!r}; a task "
                            f"file's head lies beside it (or in a folder below it), or on gs://")
    return path


def validate_common(spec) -> None:
    """The checks every kind of task shares: name, instructions, suffix template, text
    budget and overflow policy, model, version (a number in YAML becomes its string)."""
    if not isinstance(spec.name, str) or not spec.name.strip() or len(spec.name) > _MAX_NAME_CHARS:
        raise TaskSpecError(f"name: expected a non-empty string of at most {_MAX_NAME_CHARS} characters, "
                            f"got {_short(spec.name)}")
    if not isinstance(spec.instructions, str):
        raise TaskSpecError(f"instructions: expected a string, got {type(spec.instructions).__name__}")
    if not isinstance(spec.suffix_template, str):
        raise TaskSpecError("suffix_template: expected a string with one {text} slot")
    fields = _template_fields(spec.suffix_template)
    if fields != ["text"]:
        raise TaskSpecError(
            f"suffix_template: {spec.suffix_template!r} must contain exactly one {{text}} slot "
            f"and no other fields (found {fields or 'none'}); write literal braces as {{{{ }}}}"
        )
    if not isinstance(spec.max_text_tokens, int) or isinstance(spec.max_text_tokens, bool) \
            or spec.max_text_tokens < 1:
        raise TaskSpecError(f"max_text_tokens: expected a positive integer, got {spec.max_text_tokens!r}")
    if spec.overflow not in _OVERFLOW_POLICIES:
        raise TaskSpecError(f"overflow: expected one of {_OVERFLOW_POLICIES}, got {spec.overflow!r}")
    if spec.model is not None and not isinstance(spec.model, str):
        raise TaskSpecError(f"model: expected a string, got {_short(spec.model)}")
    if isinstance(spec.version, (int, float)) and not isinstance(spec.version, bool):
        object.__setattr__(spec, "version", str(spec.version))  # `version: 3` or `1.2` in YAML
    if spec.version is not None and (not isinstance(spec.version, str) or not spec.version.strip()
                                     or len(spec.version) > _MAX_NAME_CHARS):
        raise TaskSpecError(f"version: expected a non-empty string of at most {_MAX_NAME_CHARS} characters, "
                            f"got {_short(spec.version)}")


def suffix_parts(template: str) -> tuple[str, str]:
    """The literal text before and after a suffix template's `{text}` slot."""
    marker = "\x00TEXT\x00"
    head, tail = template.format(text=marker).split(marker)
    return head, tail


def _short(value: Any, limit: int = 80) -> str:
    """`repr` of a value, cut to `limit` characters: error messages stay small."""
    return _cut(repr(value), limit)


def _as_sequence(value: Any, field: str) -> Sequence:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TaskSpecError(f"{field}: expected a list, got {type(value).__name__}")
    return value


def _coerce_label(value: Any) -> Label:
    if isinstance(value, Label):
        return value
    if isinstance(value, str):
        return Label(value)
    if isinstance(value, Mapping):
        extra = set(value) - {"name", "description"}
        if extra or "name" not in value:
            raise TaskSpecError(f"labels: expected {{name, description}}, got {_short(dict(value))}")
        return Label(value["name"], value.get("description") or "")
    raise TaskSpecError(f"labels: expected a string or a mapping, got {_short(value)}")


def _coerce_example(value: Any) -> Example:
    if isinstance(value, Example):
        return value
    if isinstance(value, Mapping) and set(value) == {"text", "label"}:
        return Example(value["text"], value["label"])
    raise TaskSpecError(f"examples: expected a mapping with 'text' and 'label', got {_short(value)}")


def _template_fields(template: str) -> list[str]:
    try:
        return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise TaskSpecError(f"suffix_template: {template!r} is not a valid template: {e}") from e
