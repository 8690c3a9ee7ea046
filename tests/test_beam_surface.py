"""The Beam steps on their own, outside the CLIs (round 3): a runner that would lose rows
is refused by each transform when it is applied, naming the reason."""

from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.runners.runner import PipelineRunner

from beam_prefix.embed_transform import EmbedText
from beam_prefix.extract_transform import ExtractFields
from beam_prefix.transforms import ClassifyText

from conftest import tiny_task


class DaskRunner(PipelineRunner):
    """Stands in for Beam's DaskRunner (dask is not installed here): refused by its name."""

    def run_pipeline(self, pipeline, options):  # never reached
        raise AssertionError("the pipeline ran")


def _extract_task():
    from test_extraction import extract_task

    return extract_task()


@pytest.mark.parametrize("make", [
    lambda d: ClassifyText(task=tiny_task(), model=d),
    lambda d: ClassifyText(tasks={"a": tiny_task(), "b": tiny_task(("x", "y"))}, task_column="t", model=d),
    lambda d: EmbedText(task=tiny_task(), model=d),
    lambda d: ExtractFields(task=_extract_task(), model=d),
], ids=["classify", "classify-routed", "embed", "extract"])
def test_each_transform_refuses_the_dask_runner_in_a_users_own_pipeline(tiny_dir, make):
    p = beam.Pipeline(runner=DaskRunner())
    rows = p | beam.Create([{"text": "refund", "t": "a"}])
    with pytest.raises(ValueError, match="DaskRunner hands every consumer of a multi-output step"):
        _ = rows | make(tiny_dir)


@pytest.mark.parametrize("wrapper", ["KeyedModelHandler", "MaybeKeyedModelHandler"])
def test_beams_keyed_wrapper_around_our_handler_points_to_ours(wrapper):
    from apache_beam.ml.inference import base

    from beam_prefix.handler import PrefixCachedModelHandler

    with pytest.raises(TypeError, match="use KeyedPrefixCachedModelHandler.*validate_texts=False"):
        getattr(base, wrapper)(PrefixCachedModelHandler(task=tiny_task()))
    # the two ways out it names both work
    base.KeyedModelHandler(PrefixCachedModelHandler(task=tiny_task(), validate_texts=False))
    from beam_prefix.handler import KeyedPrefixCachedModelHandler

    assert KeyedPrefixCachedModelHandler(task=tiny_task()).get_preprocess_fns()


def test_each_step_reports_its_own_startup_rows_and_failures(tiny_dir, tmp_path):
    """ClassifyText, EmbedText and ExtractFields in one pipeline on one model: each step's
    start-up costs, rows and failures are filed under that step (they were all filed under
    whichever step ran first, and EmbedText counted no rows)."""
    import os

    from apache_beam.metrics.metric import MetricsFilter
    from apache_beam.options.pipeline_options import PipelineOptions

    model = str(tmp_path / "model")
    os.symlink(tiny_dir, model)  # a fresh path: this pipeline loads the model itself
    rows = [{"text": t} for t in ("refund my card", "the app crashes", "reset my password")] + [{"text": None}]
    p = beam.Pipeline(options=PipelineOptions(["--direct_running_mode=in_memory"]))
    created = p | beam.Create(rows)
    _ = created | "C" >> ClassifyText(task=tiny_task(), model=model)
    _ = created | "E" >> EmbedText(task=tiny_task(instructions="Read the row."), model=model)
    _ = created | "X" >> ExtractFields(task=_extract_task(), model=model)
    result = p.run()
    result.wait_until_finish()
    metrics = result.metrics().query(MetricsFilter().with_namespace("beam_prefix"))

    def per_step(kind, name):
        found = {}
        for m in metrics[kind]:
            if m.key.metric.name == name:
                step = m.key.step.split("/")[0]
                found[step] = found.get(step, 0) + (m.committed.count if kind == "distributions" else m.committed)
        return found

    for name in ("startup_prefix_build_ms", "startup_self_check_ms", "self_check_cached_us_per_row"):
        assert per_step("distributions", name) == {"C": 1, "E": 1, "X": 1}, name
    assert sum(per_step("distributions", "startup_model_load_ms").values()) == 3  # one load, 3 reports
    assert per_step("counters", "rows_classified") == {"C": 3}
    assert per_step("counters", "rows_embedded") == {"E": 3}
    extracted = per_step("counters", "rows_extracted").get("X", 0)
    failed = per_step("counters", "rows_failed")
    assert failed["C"] == 1 and failed["E"] == 1 and extracted + failed["X"] == 4


@pytest.mark.parametrize("make", [
    lambda d, **kw: ClassifyText(task=tiny_task(), model=d, **kw),
    lambda d, **kw: EmbedText(task=tiny_task(), model=d, **kw),
    lambda d, **kw: ExtractFields(task=_extract_task(), model=d, **kw),
], ids=["classify", "embed", "extract"])
@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True])
def test_a_batch_size_that_is_not_a_row_count_is_refused_when_the_step_is_built(tiny_dir, make, batch_size):
    """batch_size=0 was refused only on the worker, after the model loaded."""
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        make(tiny_dir, batch_size=batch_size)


@pytest.mark.parametrize("top_k", [0, -1, 1.5])
def test_top_k_below_one_is_refused_when_the_step_is_built(tiny_dir, top_k):
    """top_k=0 was silently taken as no top_k column."""
    with pytest.raises(ValueError, match="top_k must be a whole number >= 1"):
        ClassifyText(task=tiny_task(), model=tiny_dir, top_k=top_k)
    assert ClassifyText(task=tiny_task(), model=tiny_dir, top_k=1).config.top_k == 1
