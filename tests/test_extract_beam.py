"""ExtractFields on Beam: rows conserved, outputs equal the no-cache reference, typed
schema'd outputs, the failed reasons of extraction, metrics, and the portable runner."""

from __future__ import annotations

import typing

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_prefix.beam.extract_transform import ExtractConfig, ExtractFields, extracted_type
from beam_prefix.engines.extractor import Extractor
from beam_prefix.model.loading import load_model
from beam_prefix.beam.schemas import FAILED_TYPE

from conftest import TEXTS, tiny_task
from test_extraction import extract_task

GOOD = [{"ticket_id": f"T{i}", "text": t, "channel": "email"} for i, t in enumerate(TEXTS[:8])]
BAD = [{"ticket_id": "B1", "text": None}, {"ticket_id": "B2", "body": "no text"},
       {"ticket_id": "B3", "text": "x", "urgent": True}]  # `urgent` is an output column
BAD_REASONS = {"B1": "null_text", "B2": "missing_column", "B3": "column_clash"}


def _task(**changes):
    # 53 new tokens: of the first 8 texts, the tiny Llama closes 5 objects and cuts 3
    return extract_task(**{"max_new_tokens": 53, **changes})


class Ticket(typing.NamedTuple):
    ticket_id: str
    text: typing.Optional[str]


def _reference(model_dir, task, texts):
    ex = Extractor(task=task, loaded=load_model(model_dir), verify=False)
    return dict(zip(texts, ex.extract_full(texts)))


def test_rows_are_conserved_and_equal_the_reference(tiny_dir):
    task = _task()
    reference = _reference(tiny_dir, task, [r["text"] for r in GOOD])
    finished = {r["ticket_id"] for r in GOOD if reference[r["text"]].finished}
    assert 0 < len(finished) < len(GOOD)  # both outcomes occur with this model and budget
    expected = [(r["ticket_id"], reference[r["text"]].values, reference[r["text"]].raw_output, r["channel"])
                for r in GOOD if r["ticket_id"] in finished]
    cut = [(r["ticket_id"], "max_new_tokens", "model") for r in GOOD if r["ticket_id"] not in finished]
    with TestPipeline() as p:
        result = (p | beam.Create(GOOD + BAD)
                  | ExtractFields(task=task, model=tiny_dir, id_column="ticket_id", batch_size=3))
        assert_that(result.extracted | beam.Map(
            lambda r: (r["ticket_id"], {n: r[n] for n in task.field_names}, r["raw_output"], r["channel"])),
            equal_to(expected), label="Extracted")
        assert_that(result.failed | beam.Map(lambda r: (r["id"], r["reason"], r["stage"])),
                    equal_to(cut + [(k, v, "validate") for k, v in BAD_REASONS.items()]), label="Failed")


def test_metrics_count_generated_tokens(tiny_dir):
    task = _task()
    reference = _reference(tiny_dir, task, [r["text"] for r in GOOD])
    p = beam.Pipeline(options=PipelineOptions(["--direct_running_mode=in_memory"]))
    _ = p | beam.Create(GOOD + BAD) | ExtractFields(task=task, model=tiny_dir, verify=False)
    result = p.run()
    result.wait_until_finish()
    counters = {c.key.metric.name: c.committed for c in
                result.metrics().query(MetricsFilter().with_namespace("beam_prefix"))["counters"]}
    assert counters["generated_tokens"] == sum(e.generated_tokens for e in reference.values())
    assert counters["rows_extracted"] == sum(e.finished for e in reference.values())
    assert counters["rows_failed"] == len(BAD) + sum(not e.finished for e in reference.values())


def test_schemad_input_gives_typed_outputs(tiny_dir):
    task = _task()
    texts = [r["text"] for r in GOOD]
    reference = _reference(tiny_dir, task, texts)
    rows = [Ticket(f"T{i}", t) for i, t in enumerate(texts)] + [Ticket("B1", None)]
    with TestPipeline() as p:
        result = (p | beam.Create(rows).with_output_types(Ticket)
                  | ExtractFields(task=task, model=tiny_dir, id_column="ticket_id"))
        types = dict(result.extracted.element_type._fields)
        assert list(types)[:2] == ["ticket_id", "text"]
        assert types["product_area"] == str and types["urgent"] == bool
        assert types["seats"] == typing.Optional[int] and types["since"] == typing.Optional[str]
        assert list(types)[-4:] == ["raw_output", "truncated", "prompt_fingerprint", "model"]
        assert result.failed.element_type == FAILED_TYPE
        selected = result.extracted | beam.Select("ticket_id", "product_area", "seats")
        assert_that(selected | beam.Map(lambda r: (r.ticket_id, r.product_area, r.seats)),
                    equal_to([(f"T{i}", reference[t].values["product_area"], reference[t].values["seats"])
                              for i, t in enumerate(texts) if reference[t].finished]), label="Select")


def test_schema_types_follow_the_fields():
    task = _task(version="3")
    row_type = extracted_type(ExtractConfig(task=task, keep_columns=("id",)), [("id", str), ("text", str)])
    assert list(row_type._fields) == [("id", str), ("product_area", str), ("order_id", typing.Optional[str]),
                                ("seats", typing.Optional[int]), ("urgent", bool), ("since", typing.Optional[str]),
                                ("raw_output", str), ("truncated", bool), ("task_version", str),
                                ("prompt_fingerprint", str), ("model", str)]


def test_classification_tasks_are_refused(tmp_path):
    with pytest.raises(ValueError, match="kind: extract"):
        ExtractFields(task=tiny_task())
    with pytest.raises(ValueError, match="would be overwritten"):
        ExtractFields(task=_task(), keep_columns=["urgent"])


def test_same_output_on_the_portable_runner(tiny_dir):
    task = _task()
    reference = _reference(tiny_dir, task, [r["text"] for r in GOOD])
    expected = sorted((r["ticket_id"], reference[r["text"]].raw_output) for r in GOOD if reference[r["text"]].finished)
    options = PipelineOptions(["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=LOOPBACK"])
    with beam.Pipeline(options=options) as p:
        result = p | beam.Create(GOOD) | ExtractFields(task=task, model=tiny_dir, verify=False)
        assert_that(result.extracted | beam.Map(lambda r: (r["ticket_id"], r["raw_output"])), equal_to(expected))


def test_beam_batches_start_full_for_decoding(tiny_dir):
    """Extraction's Beam batches start at its decoding batch size (BatchElements would grow
    from 8): 20 rows of one bundle run as one batch, classification's as several."""
    from beam_prefix.beam.classify_transform import ClassifyText

    rows = [{"text": TEXTS[i % len(TEXTS)]} for i in range(20)]

    def batches(transform) -> list[int]:
        p = beam.Pipeline(options=PipelineOptions(["--direct_running_mode=in_memory"]))
        _ = p | beam.Create(rows, reshuffle=False) | transform
        result = p.run()
        result.wait_until_finish()
        dist = next(d for d in result.metrics().query(MetricsFilter().with_namespace("beam_prefix"))["distributions"]
                    if d.key.metric.name == "batch_size_rows")
        return [dist.committed.count, dist.committed.max]

    assert batches(ExtractFields(task=_task(max_new_tokens=2), model=tiny_dir, verify=False)) == [1, 20]
    assert batches(ClassifyText(task=tiny_task(), model=tiny_dir, verify=False))[0] > 1
