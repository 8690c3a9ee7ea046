"""Steps chained on one row set (route a ticket, then pull its fields), and schema'd rows
with nested or same-named fields: no input column overwritten, each metadata column
naming its step, nested values unchanged in both outputs, no row-level condition failing
the run."""

from __future__ import annotations  # the class-syntax NamedTuple below is read with it

import typing

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_prefix import PrefixClassifier
from beam_prefix.beam.extract_transform import ExtractFields
from beam_prefix.engines.extractor import Extractor
from beam_prefix.model.loading import load_model
from beam_prefix.beam.schemas import input_fields
from beam_prefix.beam.classify_transform import ClassifyText
from beam_prefix.beam.yaml_provider import ClassifyText as YamlClassifyText
from beam_prefix.beam.yaml_provider import ExtractFields as YamlExtractFields

from conftest import SUPPORT_TASK, TEXTS, tiny_task
from test_extraction import extract_task

ROWS = [("T1", TEXTS[0]), ("T2", TEXTS[1]), ("T3", TEXTS[3]), ("B1", "   ")]
CLASSIFY_META = ["truncated", "task_version", "prompt_fingerprint", "model"]


class Ticket(typing.NamedTuple):  # class syntax: string annotations under the __future__ import
    ticket_id: str
    text: typing.Optional[str]


def _inputs(kind: str):
    if kind == "dict":
        return [{"ticket_id": i, "text": t} for i, t in ROWS]
    if kind == "row":
        return [beam.Row(ticket_id=i, text=t) for i, t in ROWS]
    return [Ticket(i, t) for i, t in ROWS]


def _as_dict(row) -> dict:
    return dict(row) if isinstance(row, dict) else row._asdict() if hasattr(row, "_asdict") else row.as_dict()


@pytest.fixture(scope="module")
def references(tiny_dir):
    classify_task = tiny_task(version="c1")
    fields_task = extract_task(max_new_tokens=80, version="f1", max_text_tokens=6, overflow="reject")
    loaded = load_model(tiny_dir)
    clf = PrefixClassifier(task=classify_task, loaded=loaded, verify=False)
    ex = Extractor(task=fields_task, loaded=loaded, verify=False)
    texts = [t for _, t in ROWS[:3]]
    return classify_task, fields_task, dict(zip(texts, clf.classify_full(texts))), clf, ex


@pytest.mark.parametrize("top_k", [None, 2])
@pytest.mark.parametrize("kind", ["dict", "row", "namedtuple"])
def test_classify_then_extract_needs_no_arguments(tiny_dir, references, kind, top_k):
    classify_task, fields_task, labels, clf, ex = references
    # T1's text is over the extraction's 6-token budget (overflow: reject): it fails there alone
    finished = {t: e for t, e in zip([t for _, t in ROWS[1:3]], ex.extract_full([t for _, t in ROWS[1:3]]))}
    assert all(e.finished for e in finished.values())

    def shape(row):
        row = _as_dict(row)
        top = None if row.get("top_k") is None else [(e["label"] if isinstance(e, dict) else e.label)
                                                     for e in row["top_k"]]
        return (row["ticket_id"], row["label"], top, row["raw_output"],
                [row[c] for c in CLASSIFY_META], [row["extract_" + c] for c in CLASSIFY_META])

    expected = [(i, labels[t].label, [n for n, _ in labels[t].top(2)] if top_k else None, finished[t].raw_output,
                 [False, "c1", clf.fingerprint, clf.model_id], [False, "f1", ex.fingerprint, ex.model_id])
                for i, t in ROWS[1:3]]
    with TestPipeline() as p:
        rows = p | beam.Create(_inputs(kind))
        classified = rows | ClassifyText(task=classify_task, model=tiny_dir, id_column="ticket_id", top_k=top_k,
                                         verify=False)
        extracted = classified.labeled | ExtractFields(task=fields_task, model=tiny_dir, id_column="ticket_id",
                                                       verify=False)
        assert_that(extracted.extracted | beam.Map(shape), equal_to(expected), label="Extracted")
        assert_that(classified.failed | beam.Map(lambda r: (_as_dict(r)["id"], _as_dict(r)["reason"])),
                    equal_to([("B1", "empty_text")]), label="ClassifyFailed")
        assert_that(extracted.failed | beam.Map(lambda r: (_as_dict(r)["id"], _as_dict(r)["reason"])),
                    equal_to([("T1", "too_long")]), label="ExtractFailed")
    if kind != "dict":
        assert dict(input_fields(extracted.extracted.element_type))["extract_model"] is str


def test_an_explicit_metadata_prefix_names_both_steps(tiny_dir, references):
    classify_task, fields_task, labels, clf, ex = references
    with TestPipeline() as p:
        rows = p | beam.Create([{"ticket_id": "T2", "text": TEXTS[1]}])
        labeled = rows | ClassifyText(task=classify_task, model=tiny_dir, metadata_prefix="route_", verify=False)
        extracted = labeled.labeled | ExtractFields(task=fields_task, model=tiny_dir, metadata_prefix="fields_",
                                                    verify=False)
        assert_that(extracted.extracted | beam.Map(lambda r: (r["route_model"], r["fields_prompt_fingerprint"],
                                                                 "model" in r)),
                    equal_to([(clf.model_id, ex.fingerprint, False)]))


def test_class_syntax_named_tuple_fields_are_resolved():
    assert input_fields(Ticket) == [("ticket_id", str), ("text", typing.Optional[str])]

    def local():
        class Hidden(typing.NamedTuple):
            value: NotVisible  # noqa: F821 - the point: a name the module cannot resolve

        return Hidden

    with pytest.raises(ValueError, match="cannot be resolved.*typing.NamedTuple"):
        input_fields(local())


# -- nested input fields through both outputs -----------------------------------------------

Meta = beam.Row  # nested rows: Row(source, n)


def _nested_rows():
    """Rows with a nested Row, a list of Rows (the shape ClassifyText's top_k has), a map,
    a list of strings and a nullable nested Row; the last fails validation."""
    def row(i, text, meta):
        return beam.Row(ticket_id=i, text=text, meta=Meta(source="mail", n=len(i)),
                        top_k=[beam.Row(label="billing", score=0.5), beam.Row(label="account", score=0.25)],
                        attrs={"tier": 1, "seats": len(i)}, tags=["a", i], parent=meta)

    return [row("T1", TEXTS[1], Meta(source="crm", n=7)), row("T22", TEXTS[4], None), row("B1", None, None)]


def _nested(row):
    row = _as_dict(row)

    def plain(value):
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return dict(sorted(value.items()))
        if value is not None and not isinstance(value, (str, int, float)):
            return plain(_as_dict(value))
        return value

    return tuple(plain(row[name]) for name in ("ticket_id", "meta", "top_k", "attrs", "tags", "parent"))


@pytest.mark.parametrize("step", ["classify", "extract"])
def test_nested_fields_pass_through_both_outputs_unchanged(tiny_dir, step):
    rows = _nested_rows()
    expected = [_nested(r) for r in rows]
    if step == "classify":  # no top_k of its own: the input's top_k is a field like any other
        transform, main = YamlClassifyText(task=str(SUPPORT_TASK), model=tiny_dir,
                                           id_column="ticket_id", verify=False,
                                           error_handling={"output": "errors"}), "labeled"
    else:
        transform, main = YamlExtractFields(task=str(_fields_file()), model=tiny_dir, id_column="ticket_id",
                                            max_new_tokens=3, verify=False,
                                            error_handling={"output": "errors"}), "extracted"
    with TestPipeline() as p:
        outputs = p | beam.Create(rows) | transform
        assert sorted(outputs) == sorted([main, "errors"])  # two outputs: a chain follows the main one
        good = outputs[main]
        if step == "extract":  # 3 new tokens close no object: every good row fails in the model stage
            good = outputs["errors"] | beam.Filter(lambda e: e.stack == "model") | beam.Map(lambda e: e.element)
        assert_that(good | "Good" >> beam.Map(_nested), equal_to(expected[:2]), label="Good")
        assert_that(outputs["errors"] | beam.Filter(lambda e: e.stack == "validate")
                    | beam.Map(lambda e: _nested(e.element)), equal_to(expected[2:]), label="Errors")


def _fields_file():
    import json
    import tempfile

    from test_extraction import FIELDS

    path = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    path.write(json.dumps({"kind": "extract", "instructions": "Fill in the fields.", "fields": FIELDS}))
    path.close()
    return path.name
