"""The Python API refuses where a step is built what the CLI refuses at launch (#56.7): a
schema'd input whose schema lacks the text column (every row would fail as
``missing_column``), for each step kind. (A head used in another precision than it was fit
in is refused at construction too: tests/test_feature_search.py.)"""

from __future__ import annotations

import apache_beam as beam
import pytest

from beam_prefix.embed_transform import EmbedText
from beam_prefix.extract_transform import ExtractFields
from beam_prefix.transforms import ClassifyText

from conftest import ROOT, tiny_task

EXTRACT_TASK = str(ROOT / "pipelines" / "tasks" / "ticket_fields.yaml")


@pytest.mark.parametrize("step", [
    lambda d, **k: ClassifyText(task=tiny_task(), model=d, **k),
    lambda d, **k: ClassifyText(tasks={"a": tiny_task()}, task_column="tenant", model=d, **k),
    lambda d, **k: ExtractFields(task=EXTRACT_TASK, model=d, **k),
    lambda d, **k: EmbedText(task=tiny_task(), model=d, **k),
], ids=["classify", "routed", "extract", "embed"])
def test_a_schemad_input_without_the_text_column_is_refused_where_the_pipeline_is_built(step, tiny_dir):
    p = beam.Pipeline()
    rows = p | beam.Create([beam.Row(tenant="a", body="I was charged twice")])
    with pytest.raises(ValueError, match="no text column 'text'.*'tenant', 'body'"):
        _ = rows | "Refused" >> step(tiny_dir)
    # naming the column that holds the text builds
    _ = rows | "Built" >> step(tiny_dir, text_column="body")


def test_the_transforms_take_the_task_as_their_one_positional_argument(tiny_dir):
    """#56.4: ``ClassifyText("tasks/x.yaml")`` as documented, and the same for the other
    steps and the RunInference handler; every other argument stays keyword-only."""
    from beam_prefix.handler import PrefixCachedModelHandler

    task = tiny_task()
    assert ClassifyText(task, model=tiny_dir).config.task is task
    assert EmbedText(task, model=tiny_dir).config.task.name == task.name  # (as a features task)
    assert ExtractFields(EXTRACT_TASK, model=tiny_dir).config.task.name == "ticket_fields"
    assert PrefixCachedModelHandler(task, model=tiny_dir)._task is task
    with pytest.raises(TypeError):
        ClassifyText(task, tiny_dir)  # the model by keyword only
