"""Beam-native outputs: schema'd `labeled`/`failed` for schema'd input (`beam.Select`,
`to_dataframe`), and streaming: each row keeps its own timestamp and window, on
`TestStream` with bursts, watermark and processing-time advances."""

from __future__ import annotations

import typing

import apache_beam as beam
import numpy as np
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms import window

from beam_prefix import PrefixClassifier
from beam_prefix.model.loading import load_model
from beam_prefix.beam.schemas import FAILED_TYPE
from beam_prefix.beam.classify_transform import ClassifyText

from conftest import TEXTS, tiny_task

LABELS = ("billing", "technical", "account")


def _task():
    return tiny_task(LABELS, overflow="reject", max_text_tokens=64)


def _labels(model_dir, texts):
    clf = PrefixClassifier(task=_task(), loaded=load_model(model_dir), verify=False)
    return {t: p.label for t, p in zip(texts, clf.classify_full(texts))}


# functional form: under `from __future__ import annotations` class-syntax field types are
# strings, which Beam's schema inference reads as Any
Ticket = typing.NamedTuple("Ticket", [("ticket_id", str), ("text", typing.Optional[str]), ("priority", int)])


def test_schemad_input_gives_schemad_outputs(tiny_dir):
    expected = _labels(tiny_dir, TEXTS[:6])
    rows = [Ticket(f"T{i}", t, i % 3) for i, t in enumerate(TEXTS[:6])] + [Ticket("B1", None, 0)]
    with TestPipeline() as p:
        result = (p | beam.Create(rows).with_output_types(Ticket)
                  | ClassifyText(task=_task(), model=tiny_dir, id_column="ticket_id", top_k=2))
        types = dict(result.labeled.element_type._fields)
        fields = list(types)
        assert fields[:3] == ["ticket_id", "text", "priority"] and fields[3:5] == ["label", "score"]
        assert types["priority"] in (int, np.int64) and types["truncated"] == bool  # Beam maps int to int64
        assert "top_k" in fields and fields[-3:] == ["truncated", "prompt_fingerprint", "model"]
        assert result.failed.element_type == FAILED_TYPE
        selected = result.labeled | beam.Select("ticket_id", "label")
        assert_that(selected | beam.Map(lambda r: (r.ticket_id, r.label)),
                    equal_to([(f"T{i}", expected[t]) for i, t in enumerate(TEXTS[:6])]), label="Select")
        assert_that(result.labeled | beam.Map(lambda r: [e.label for e in r.top_k][0] == r.label),
                    equal_to([True] * 6), label="TopKRows")
        assert_that(result.failed | beam.Map(lambda r: (r.id, r.reason, r.stage)),
                    equal_to([("B1", "null_text", "validate")]), label="FailedRow")


def test_labeled_rows_convert_to_a_dataframe(tiny_dir):
    from apache_beam.dataframe.convert import to_dataframe, to_pcollection

    rows = [beam.Row(ticket_id=f"T{i}", text=t) for i, t in enumerate(TEXTS[:4])]
    expected = _labels(tiny_dir, TEXTS[:4])
    with TestPipeline() as p:
        result = p | beam.Create(rows) | ClassifyText(task=_task(), model=tiny_dir)
        df = to_dataframe(result.labeled)
        billing = to_pcollection(df[["ticket_id", "label", "prob_billing"]], include_indexes=False)
        assert_that(billing | beam.Map(lambda r: (r.ticket_id, r.label)),
                    equal_to([(f"T{i}", expected[t]) for i, t in enumerate(TEXTS[:4])]))


def test_streaming_rows_keep_their_timestamps_and_windows(tiny_dir):
    """Bursts of rows at event times 1..25 s, with watermark and processing-time advances:
    after classification each row still has its own timestamp, and windowing into 10 s
    windows groups them by their event time (not all into one far-future window)."""
    texts = TEXTS[:8]
    times = [1, 2, 3, 11, 12, 21, 22, 25]
    expected = _labels(tiny_dir, texts)
    stream = (TestStream()
              .add_elements([window.TimestampedValue({"text": t, "ts": s}, s) for t, s in zip(texts[:3], times[:3])])
              .advance_processing_time(5)
              .advance_watermark_to(10)
              .add_elements([window.TimestampedValue({"text": t, "ts": s}, s) for t, s in zip(texts[3:5], times[3:5])])
              .advance_processing_time(5)
              .advance_watermark_to(20)
              .add_elements([window.TimestampedValue({"text": t, "ts": s}, s) for t, s in zip(texts[5:], times[5:])])
              .advance_processing_time(5)
              .advance_watermark_to_infinity())
    options = PipelineOptions()
    options.view_as(StandardOptions).streaming = True
    with TestPipeline(options=options) as p:
        result = p | stream | ClassifyText(task=_task(), model=tiny_dir, verify=False)
        stamped = result.labeled | beam.Map(lambda r, ts=beam.DoFn.TimestampParam: (r["text"], r["label"], ts.micros // 10**6, r["ts"]))
        assert_that(stamped, equal_to([(t, expected[t], s, s) for t, s in zip(texts, times)]), label="Timestamps")
        per_window = (result.labeled | beam.WindowInto(window.FixedWindows(10))
                      | beam.Map(lambda r: ("n", 1)) | beam.CombinePerKey(sum)
                      | beam.Map(lambda kv, w=beam.DoFn.WindowParam: (int(w.start), kv[1])))
        assert_that(per_window, equal_to([(0, 3), (10, 2), (20, 3)]), label="Windows")


def test_max_batch_duration_secs_buffers_across_bundles(tiny_dir):
    """Beam's stateful batching (keyed, timers): the same labels, every row once."""
    expected = _labels(tiny_dir, TEXTS)
    with TestPipeline() as p:
        result = (p | beam.Create([{"text": t} for t in TEXTS])
                  | ClassifyText(task=_task(), model=tiny_dir, max_batch_duration_secs=1, verify=False))
        assert_that(result.labeled | beam.Map(lambda r: (r["text"], r["label"])), equal_to(list(expected.items())))


def test_schemad_output_with_top_k_goes_into_write_to_parquet(tiny_dir, tmp_path):
    """#56.8: Beam's WriteToParquet cannot convert the nested top_k rows itself (ArrowTypeError:
    Could not convert Row(label=..., score=...)); with `parquet_schema` and `parquet_row`
    the labelled rows are written with their types: the top_k list of structs, the input's
    int column, a nullable text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from beam_prefix.beam.schemas import parquet_row, parquet_schema

    rows = [Ticket(f"T{i}", t, i) for i, t in enumerate(TEXTS[:5])]
    with beam.Pipeline() as p:
        labeled = (p | beam.Create(rows).with_output_types(Ticket)
                   | ClassifyText(task=tiny_task(), model=tiny_dir, top_k=2, verify=False)).labeled
        schema = parquet_schema(labeled.element_type)
        _ = (labeled | beam.Map(parquet_row)
             | beam.io.WriteToParquet(str(tmp_path / "labeled"), schema, file_name_suffix=".parquet"))
    assert schema.field("top_k").type == pa.list_(pa.field("item", pa.struct(
        [pa.field("label", pa.string(), nullable=False), pa.field("score", pa.float64(), nullable=False)]),
        nullable=False))
    assert schema.field("priority").type == pa.int64() and schema.field("text").nullable
    table = pq.read_table(next(tmp_path.glob("labeled-*.parquet")))
    assert sorted(table.column("ticket_id").to_pylist()) == [f"T{i}" for i in range(5)]
    for entry in table.to_pylist():
        assert [e["label"] for e in entry["top_k"]][0] == entry["label"] and len(entry["top_k"]) == 2
