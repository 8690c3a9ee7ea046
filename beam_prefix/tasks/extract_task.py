"""The extraction task: instructions, typed fields, few-shot examples, suffix template.

An `ExtractionSpec` asks the model for one JSON object per row with exactly the task's
fields, in their order. Like `TaskSpec` it is pure configuration, validated at
construction with a `TaskSpecError` that names the field; `json_schema()` is the schema
that constrained decoding enforces (`beam_prefix.engines.constraints`), so every output parses
and every enum is one of its values.

Task file format (``kind: extract``; a file without ``kind`` is a classification task)::

    kind: extract
    instructions: |
      Read the support ticket and fill in the fields.
    fields:
      - {name: product_area, type: enum, values: [billing, app, account, other]}
      - {name: order_id, type: string, required: false, description: "order or invoice id"}
      - {name: urgent, type: boolean}
      - {name: amount, type: number, required: false}
    examples:                     # the output must match the fields
      - text: "I was charged twice for order A-1 (40 EUR)"
        output: {product_area: billing, order_id: A-1, urgent: false, amount: 40}
    suffix_template: "Ticket: {text}"
    max_new_tokens: 96            # output tokens; a row cut before its object closes fails
    max_text_tokens: 256
    overflow: truncate
    version: "1"

With labelled rows, ``scoring: head`` and ``head: FILE`` (relative to the task file) read
the fields off the row's hidden states with a head fit by ``pipelines.fit``
(`extraction_head.ExtractionHead`), no decoding; its span fields (``string``, ``number``,
``integer``, ``date``) need ``required: false``, since the head may find no span.

Field types: ``string`` (``max_length`` characters, default 200), ``integer`` and
``number`` (at most 15 digits either side of zero, so int64/float64 columns hold them
exactly), ``boolean``, ``enum`` (``values``: strings), ``date`` (``YYYY-MM-DD``, years
0001-9999; the grammar knows each month's days but not leap years, so a generated
February 29 of a common year is caught after decoding: the row reports it as a problem). A field
is required by default; ``required: false`` (or ``nullable: true``) lets the model answer
``null`` when the text does not say.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from typing import Any, Mapping

from beam_prefix.errors import TaskSpecError
from beam_prefix.tasks.task import PromptTask, TaskSpec, _as_sequence, _short, confined_head, validate_common
from beam_prefix.tasks.shipped import resolve_task
from beam_prefix.tasks.task_file import read_task_file, refuse_invisible, refuse_lookalikes

__all__ = ["Field", "ExtractExample", "ExtractionSpec", "FIELD_TYPES", "EXTRACT_SCORINGS", "load_task"]

FIELD_TYPES = ("string", "integer", "number", "boolean", "enum", "date")
# integers and numbers stay within 15 digits: int64 and float64 columns hold them exactly
# (an unbounded JSON integer from a small model can run to dozens of digits)
NUMBER_LIMIT = 10 ** 15 - 1
_YEAR_FROM_1 = "^(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")  # a column name in Parquet, BigQuery and Beam
_FIELD_KEYS = {"name", "type", "description", "values", "required", "nullable", "max_length"}
_KNOWN_KEYS = {"kind", "name", "instructions", "fields", "examples", "suffix_template", "model",
               "max_text_tokens", "overflow", "max_new_tokens", "version", "scoring", "head"}
EXTRACT_SCORINGS = ("generate", "head")  # constrained decoding, or a head fit on labelled rows


@dataclasses.dataclass(frozen=True)
class Field:
    """One output field.

    Attributes:
        name: the JSON key and output column (letters, digits, underscore).
        type: one of `FIELD_TYPES`.
        description: what the model is told about it.
        values: an enum's allowed strings.
        nullable: the model may answer null (``required: false`` in the task file).
        max_length: a string's longest value, in characters.
    """

    name: str
    type: str
    description: str = ""
    values: tuple[str, ...] = ()
    nullable: bool = False
    max_length: int = 200

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise TaskSpecError(f"fields: field name {_short(self.name)} must be letters, digits or '_' "
                                f"(not starting with a digit, at most 64)")
        where = f"fields: field {self.name!r}"
        if self.type not in FIELD_TYPES:
            raise TaskSpecError(f"{where}: type must be one of {FIELD_TYPES}, got {_short(self.type)}")
        if not isinstance(self.description, str):
            raise TaskSpecError(f"{where}: description must be a string")
        values = self.values
        if self.type == "enum":
            if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or len(values) < 2:
                raise TaskSpecError(f"{where}: an enum needs 'values', a list of at least two strings")
            if not all(isinstance(v, str) and v and v == v.strip() and "\n" not in v for v in values):
                raise TaskSpecError(f"{where}: enum values must be non-empty one-line strings, got {_short(values)}")
            if len(set(values)) != len(values):
                raise TaskSpecError(f"{where}: enum values repeat: {_short(values)}")
            for v in values:
                refuse_invisible(v, f"{where}: enum value")
            refuse_lookalikes(values, f"{where}: enum values")
            object.__setattr__(self, "values", tuple(values))
        elif values:
            raise TaskSpecError(f"{where}: 'values' is only for type enum")
        if not isinstance(self.nullable, bool):
            raise TaskSpecError(f"{where}: required/nullable must be true or false")
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or not 1 <= self.max_length <= 10_000:
            raise TaskSpecError(f"{where}: max_length must be an integer from 1 to 10000, got {_short(self.max_length)}")

    def json_schema(self) -> dict:
        if self.type == "enum":
            schema: dict = {"enum": list(self.values)}
        elif self.type == "string":
            schema = {"type": "string", "maxLength": self.max_length}
        elif self.type == "date":  # the format allows year 0000, which no date column holds
            schema = {"type": "string", "format": "date", "pattern": _YEAR_FROM_1}
        elif self.type in ("integer", "number"):
            schema = {"type": self.type, "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}
        else:
            schema = {"type": self.type}
        return {"anyOf": [schema, {"type": "null"}]} if self.nullable else schema

    def check(self, value: Any) -> str | None:
        """Why `value` is not a valid value of this field (None when it is)."""
        if value is None:
            return None if self.nullable else "is null but the field is required"
        ok = {"string": lambda v: isinstance(v, str) and len(v) <= self.max_length,
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) <= NUMBER_LIMIT,
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= NUMBER_LIMIT,
              "boolean": lambda v: isinstance(v, bool),
              "enum": lambda v: v in self.values,
              "date": _is_date}[self.type](value)
        return None if ok else f"{_short(value)} is not a valid {self.type}"


@dataclasses.dataclass(frozen=True)
class ExtractExample:
    """A few-shot example: a text and the object the model should answer."""

    text: str
    output: Mapping[str, Any]

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise TaskSpecError(f"examples: every example needs a non-empty text, got {_short(self.text)}")
        if not isinstance(self.output, Mapping):
            raise TaskSpecError(f"examples: output of example {self.text[:40]!r} must be a mapping of fields")


@dataclasses.dataclass(frozen=True)
class ExtractionSpec(PromptTask):
    """An extraction task, independent of any model (see the module docstring).

    Args:
        instructions: the static instructions (system message in chat models).
        fields: the output fields, in output order.
        examples: few-shot examples, rendered as static conversation turns.
        suffix_template: the per-row text, with exactly one `{text}` slot.
        name: a short name used in logs.
        model: optional default model.
        max_text_tokens: token budget for one row's text; overflow: `truncate` or `reject`.
        max_new_tokens: the most tokens generated per row.
        version: optional prompt version, in the fingerprint and on every output row.
        scoring: ``generate`` (default: constrained decoding) or ``head`` (the fields read
            off the row's hidden states by `head`, fit on labelled rows; no decoding).
        head: with ``scoring: head``, the `extraction_head.ExtractionHead` or its file's path
            (in a task file: relative to the file). Its span fields must be nullable (the
            head may find no span).
    """

    instructions: str
    fields: tuple[Field, ...]
    examples: tuple[ExtractExample, ...] = ()
    suffix_template: str = "Ticket: {text}"
    name: str = "task"
    model: str | None = None
    max_text_tokens: int = 256
    overflow: str = "truncate"
    max_new_tokens: int = 128
    version: str | None = None
    scoring: str = "generate"
    head: Any = None

    kind = "extract"

    def __post_init__(self):
        fields = tuple(_coerce_field(f) for f in _as_sequence(self.fields, "fields"))
        object.__setattr__(self, "fields", fields)
        examples = tuple(_coerce_example(e) for e in _as_sequence(self.examples, "examples"))
        object.__setattr__(self, "examples", examples)
        validate_common(self)
        if not fields:
            raise TaskSpecError("fields: an extraction task needs at least one field")
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise TaskSpecError(f"fields: duplicate field name(s) {sorted({n for n in names if names.count(n) > 1})}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or not 1 <= self.max_new_tokens <= 4096:
            raise TaskSpecError(f"max_new_tokens: expected an integer from 1 to 4096, got {_short(self.max_new_tokens)}")
        for example in examples:
            self.check_output(example.output, where=f"examples: output of example {example.text[:40]!r}")
        self._validate_head()

    def _validate_head(self) -> None:
        """``scoring: head`` needs a head fit for exactly these fields, whose span fields are
        nullable; a head needs ``scoring: head``."""
        if self.scoring not in EXTRACT_SCORINGS:
            raise TaskSpecError(f"scoring: an extraction task's scoring is one of {EXTRACT_SCORINGS}, "
                                f"got {_short(self.scoring)}")
        if self.head is None:
            if self.scoring == "head":
                raise TaskSpecError("scoring: head needs a head (head: FILE; fit one with python -m "
                                    "beam_prefix.pipelines.fit --task THIS_TASK)")
            return
        if self.scoring != "head":
            raise TaskSpecError(f"head: an extraction head is used with scoring: head, not {self.scoring!r}")
        from beam_prefix.tasks.extraction_head import ExtractionHead, field_signature
        from beam_prefix.tasks.span_tags import SPAN_TYPES

        if isinstance(self.head, (str, os.PathLike)):
            object.__setattr__(self, "head", ExtractionHead.load(self.head))
        if not isinstance(self.head, ExtractionHead):
            raise TaskSpecError(f"head: expected an extraction head file path, got {type(self.head).__name__}")
        strict = [f.name for f in self.fields if f.type in SPAN_TYPES and not f.nullable]
        if strict:
            raise TaskSpecError(f"fields: {strict} are read from a span of the text, which a head may not find: "
                                f"with scoring: head they need required: false")
        if self.head.fields != field_signature(self.fields):
            raise TaskSpecError(f"head {self.head.source or self.head.identity} was fit for fields {self.head.fields}, "
                                f"the task has {field_signature(self.fields)}")

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def check_output(self, obj: Any, *, where: str = "output") -> None:
        """Raise `TaskSpecError` unless `obj` has exactly the fields, each valid."""
        if not isinstance(obj, Mapping):
            raise TaskSpecError(f"{where}: expected an object, got {_short(obj)}")
        missing = [n for n in self.field_names if n not in obj]
        extra = sorted(set(obj) - set(self.field_names), key=str)
        if missing or extra:
            raise TaskSpecError(f"{where}: fields missing {missing}, unknown {extra[:5]}")
        for f in self.fields:
            problem = f.check(obj[f.name])
            if problem:
                raise TaskSpecError(f"{where}: field {f.name!r}: {problem}")

    def json_schema(self) -> dict:
        """The output's JSON schema: an object with exactly the fields, all present."""
        return {"type": "object", "properties": {f.name: f.json_schema() for f in self.fields},
                "required": list(self.field_names), "additionalProperties": False}

    def render_output(self, obj: Mapping[str, Any]) -> str:
        """An object as the model is taught to write it: compact JSON, fields in order."""
        return json.dumps({n: obj[n] for n in self.field_names}, ensure_ascii=False, separators=(",", ":"))

    # -- what the prompt renders (the same questions `TaskSpec` answers) ------------------

    def system_text(self) -> str:
        lines = []
        for f in self.fields:
            kind = f"one of {', '.join(f.values)}" if f.type == "enum" else f.type
            if f.type == "date":
                kind = "date, YYYY-MM-DD"
            null = "; null if the text does not say" if f.nullable else ""
            desc = f": {f.description}" if f.description else ""
            lines.append(f"- {f.name} ({kind}{null}){desc}")
        parts = [self.instructions.strip(), "Fields:\n" + "\n".join(lines),
                 "Answer with one JSON object with exactly these fields, in this order, and nothing else."]
        return "\n\n".join(p for p in parts if p)

    def example_turns(self) -> tuple[tuple[str, str], ...]:
        return tuple((e.text, self.render_output(e.output)) for e in self.examples)

    def static_strings(self) -> list[tuple[str, str]]:
        out = [(f"fields: field {f.name!r}", " ".join((f.description, *f.values))) for f in self.fields]
        out += [(f"examples: example {text[:40]!r}", text + "\n" + answer) for text, answer in self.example_turns()]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "task", base_dir: str | None = None) -> "ExtractionSpec":
        """Build a task from a parsed mapping (the YAML document); a relative `head` path is
        read from `base_dir` (the task file's directory), confined to it."""
        if isinstance(data, Mapping) and isinstance(data.get("head"), str) and base_dir \
                and "://" not in data["head"]:  # (gs://: as written)
            data = {**data, "head": confined_head(data["head"], base_dir, source)}
        return cls._from_mapping(data, source, _KNOWN_KEYS, "fields", "an extraction task needs at least one field",
                                 ("examples",))


def load_task(source) -> TaskSpec | ExtractionSpec:
    """A task of either kind from a task file path, a shipped task's name
    (`shipped.resolve_task`) or a parsed mapping (by its ``kind:``); a task object is
    returned as it is."""
    if isinstance(source, (TaskSpec, ExtractionSpec)):
        return source
    if isinstance(source, Mapping):
        data, where, path = source, "task", None
    else:
        path = resolve_task(source)
        data, where = read_task_file(path), f"task file {path!r}"
    kind = data.get("kind", "classify") if isinstance(data, Mapping) else "classify"
    if kind not in ("classify", "extract"):
        raise TaskSpecError(f"{where}: kind must be 'classify' or 'extract', got {_short(kind)}")
    base_dir = os.path.dirname(os.path.abspath(path)) if path is not None else None
    if kind == "extract":
        spec = ExtractionSpec.from_dict(data, source=where, base_dir=base_dir)
    else:
        spec = TaskSpec.from_dict(data, source=where, base_dir=base_dir)
    if path is not None and spec.name == "task":
        spec = spec.replace(name=os.path.splitext(os.path.basename(path))[0])
    return spec


def _is_date(value: Any) -> bool:
    if not isinstance(value, str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
        return False
    try:
        datetime.date.fromisoformat(value)
    except ValueError:
        return False
    return True


def _coerce_field(value: Any) -> Field:
    if isinstance(value, Field):
        return value
    if not isinstance(value, Mapping):
        raise TaskSpecError(f"fields: expected a mapping with name and type, got {_short(value)}")
    extra = sorted(set(value) - _FIELD_KEYS, key=str)
    if extra or "name" not in value or "type" not in value:
        raise TaskSpecError(f"fields: field {_short(value.get('name'))} needs name and type, and only "
                            f"{sorted(_FIELD_KEYS)} (unknown: {extra})")
    required, nullable = value.get("required", True), value.get("nullable", False)
    if not isinstance(required, bool) or not isinstance(nullable, bool):
        raise TaskSpecError(f"fields: field {_short(value['name'])}: required/nullable must be true or false")
    if "required" in value and "nullable" in value and required == nullable:
        raise TaskSpecError(f"fields: field {_short(value['name'])}: required: {required} contradicts "
                            f"nullable: {nullable}; give one of them")
    kwargs = {k: value[k] for k in ("description", "values", "max_length") if k in value}
    return Field(value["name"], value["type"], nullable=nullable or not required, **kwargs)


def _coerce_example(value: Any) -> ExtractExample:
    if isinstance(value, ExtractExample):
        return value
    if isinstance(value, Mapping) and set(value) == {"text", "output"}:
        return ExtractExample(value["text"], value["output"])
    raise TaskSpecError(f"examples: expected a mapping with 'text' and 'output', got {_short(value)}")
