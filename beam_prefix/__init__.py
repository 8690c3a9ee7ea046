"""beam-prefix: fast text classification and extraction with a prefix-cached causal LM, for Apache Beam.

The static part of the prompt (instructions, labels or fields, few-shot examples) is run
through the model once; every row then costs only its own suffix tokens (and, for
extraction, the tokens it generates).

    from beam_prefix import TaskSpec, PrefixClassifier, Extractor
    task = TaskSpec.from_yaml("support_tickets")  # a shipped task's name (shipped_tasks()), or a file's path
    clf = PrefixClassifier.load(task, model="embedded")
    clf.classify(["I was charged twice"])[0].label
    Extractor.load("ticket_fields").extract(["Refund order A-17"])[0].values

The Beam steps are `beam_prefix.beam.classify_transform.ClassifyText`,
`beam_prefix.beam.extract_transform.ExtractFields` and `beam_prefix.beam.embed_transform.EmbedText`;
a task with ``scoring: head`` answers with a head fit by ``python -m beam_prefix.pipelines.fit``
(a classification task's `TrainedHead`, an extraction task's `ExtractionHead`).
"""

from beam_prefix.engines.classifier import PrefixClassifier
from beam_prefix.engines.predictions import Embedding, Prediction
from beam_prefix.errors import (BeamPrefixError, BoundaryError, ModelLoadError, RowError,
                                TaskSpecError, TextTooLongError, VerificationError)
from beam_prefix.tasks.extract_task import ExtractExample, ExtractionSpec, Field, load_task
from beam_prefix.engines.extractor import Extraction, Extractor
from beam_prefix.engines.extraction_fitting import fit_extraction_head
from beam_prefix.engines.head_fitting import fit_head
from beam_prefix.engines.model_tuning import tune_model
from beam_prefix.model.embedded_staging import stage_embedded_model
from beam_prefix.tasks.shipped import shipped_tasks
from beam_prefix.tasks.task import Example, Label, TaskSpec
from beam_prefix.tasks.extraction_head import ExtractionHead
from beam_prefix.tasks.trained_head import TrainedHead

__version__ = "0.1.0"

__all__ = [
    "TaskSpec", "Label", "Example", "PrefixClassifier", "Prediction", "Embedding", "TrainedHead",
    "ExtractionSpec", "Field", "ExtractExample", "Extractor", "Extraction", "load_task",
    "BeamPrefixError", "TaskSpecError", "BoundaryError", "ModelLoadError", "RowError",
    "TextTooLongError", "VerificationError", "fit_head", "tune_model", "shipped_tasks", "stage_embedded_model",
    "ExtractionHead", "fit_extraction_head",
]
