"""The Beam floor: the engines as Beam steps.

`classify_transform.ClassifyText`, `extract_transform.ExtractFields`,
`embed_transform.EmbedText` (schema'd rows in, a main and a ``failed`` output out), built on
`step` (a step's settings, rows, batching, failed records) and `worker` (one model per
process, a bounded `prefix_pool` of prompts, per-step threads and `metrics`); `routing`
sends each row to its task's prompt; `handler` is the RunInference face, `yaml_provider`
the Beam YAML one, `schemas` the output row types (BigQuery included).
Users import these through the old paths too (`beam_prefix.transforms`, ...).
"""

from beam_prefix.beam.classify_transform import ClassifyText
from beam_prefix.beam.embed_transform import EmbedText
from beam_prefix.beam.extract_transform import ExtractFields
from beam_prefix.beam.handler import KeyedPrefixCachedModelHandler, PrefixCachedModelHandler

__all__ = ["ClassifyText", "ExtractFields", "EmbedText", "PrefixCachedModelHandler",
           "KeyedPrefixCachedModelHandler"]
