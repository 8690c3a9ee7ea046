"""Errors raised by beam-prefix, one class per thing that can go wrong.

Row-level errors (`RowError` and subclasses) describe a single bad input; the Beam
transforms turn them into rows of the failed output instead of failing the job.
"""

__all__ = [
    "BeamPrefixError",
    "TaskSpecError",
    "BoundaryError",
    "ModelLoadError",
    "ContextLengthError",
    "RowError",
    "TextTooLongError",
    "NonFiniteScoreError",
    "VerificationError",
]


class BeamPrefixError(Exception):
    """Base class of every error beam-prefix raises on purpose."""


class TaskSpecError(BeamPrefixError, ValueError):
    """A task file or `TaskSpec` is malformed (names the field and the fix)."""


class BoundaryError(BeamPrefixError, ValueError):
    """The prefix/suffix (or suffix/label) split is not token-clean."""


class ModelLoadError(BeamPrefixError, RuntimeError):
    """The model or tokenizer cannot be loaded."""


class ContextLengthError(BeamPrefixError, ValueError):
    """The task's prompt (prefix, suffix template, text budget, labels) does not fit the model's context."""


class RowError(BeamPrefixError, ValueError):
    """One input text cannot be classified; `reason` is a short machine-friendly code."""

    def __init__(self, message: str, *, reason: str = "bad_row"):
        super().__init__(message)
        self.reason = reason


class TextTooLongError(RowError):
    """A text exceeds the token budget and the task's overflow policy is `reject`."""

    def __init__(self, message: str):
        super().__init__(message, reason="too_long")


class NonFiniteScoreError(RowError):
    """The model or head gave a row a score that is not a number (NaN or infinite)."""

    def __init__(self, message: str):
        super().__init__(message, reason="non_finite_score")


class VerificationError(BeamPrefixError, AssertionError):
    """Cached scoring disagrees with full re-encoding; `texts` are the offending inputs."""

    def __init__(self, message: str, texts: list):
        super().__init__(message)
        self.texts = texts
