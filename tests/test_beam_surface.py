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
