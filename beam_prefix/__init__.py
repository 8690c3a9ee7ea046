"""beam-prefix: fast text classification with a prefix-cached causal LM, for Apache Beam.

The static part of the prompt (instructions, labels, few-shot examples) is run through
the model once; every row then costs only its own suffix tokens.

    from beam_prefix import TaskSpec, PrefixClassifier
    task = TaskSpec.from_yaml("pipelines/tasks/support_tickets.yaml")
    clf = PrefixClassifier.load(task, model="embedded")
    clf.classify(["I was charged twice"])[0].label
"""

from beam_prefix.classifier import Prediction, PrefixClassifier
from beam_prefix.errors import (BeamPrefixError, BoundaryError, ModelLoadError, RowError,
                                TaskSpecError, TextTooLongError, VerificationError)
from beam_prefix.task import Example, Label, TaskSpec

__version__ = "0.1.0"

__all__ = [
    "TaskSpec", "Label", "Example", "PrefixClassifier", "Prediction",
    "BeamPrefixError", "TaskSpecError", "BoundaryError", "ModelLoadError", "RowError",
    "TextTooLongError", "VerificationError",
]
