"""`PrefixCachedModelHandler`: the same cached scoring behind Beam's `RunInference`.

    from apache_beam.ml.inference.base import RunInference
    texts | RunInference(PrefixCachedModelHandler(task=task, model="embedded"))

`load_model` loads the model and builds the prefix cache; RunInference shares the result
between the threads of a worker (or, with ``large_model=True`` / ``model_copies``, between
its processes through `MultiProcessShared`). The loaded object is a `ServedClassifier`:
`classify` may be called from many threads at once, each classifying through its own fork
(shared weights and prefix; with the expanded engine its own working cache), and it
pickles nothing but texts and predictions when it lives in another process.

Bad texts fail alone: the handler's preprocessing step validates each text (its own
tokenizer, no model), so under ``RunInference(...).with_exception_handling()`` a ``None``
or an over-budget text goes to ``failed_preprocessing`` with its `RowError` and never
fails the good texts batched with it.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Optional, Sequence

from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from beam_prefix.classifier import PrefixClassifier
from beam_prefix.model import EMBEDDED, load_tokenizer
from beam_prefix.prompt import PromptLayout
from beam_prefix.task import TaskSpec

__all__ = ["PrefixCachedModelHandler", "ServedClassifier", "TextValidator"]


class ServedClassifier:
    """What `PrefixCachedModelHandler.load_model` returns: one base classifier, classified
    through per-thread forks. Only methods cross a process boundary (a proxy exposes no
    attributes), so the model id is a method too."""

    def __init__(self, classifier: PrefixClassifier):
        self.classifier = classifier
        self._local = threading.local()

    def _fork(self) -> PrefixClassifier:
        fork = getattr(self._local, "fork", None)
        if fork is None:
            fork = self._local.fork = self.classifier.fork()
        return fork

    def classify(self, texts: Sequence[str]):
        return self._fork().classify(list(texts))

    def model_id(self) -> str:
        return self.classifier.model_id


# per process: the prompt layout each (task, model) validates texts with
_LAYOUTS: dict[tuple[str, str], PromptLayout] = {}
_LAYOUTS_LOCK = threading.Lock()


class TextValidator:
    """A preprocessing function: returns the text unchanged, or raises the `RowError` (with
    its reason) that the classifier would raise for it. Loads only the tokenizer, once per
    process."""

    def __init__(self, task: TaskSpec, model: str):
        self.task, self.model = task, model

    def _layout(self) -> PromptLayout:
        key = (self.model, repr(self.task))
        with _LAYOUTS_LOCK:
            layout = _LAYOUTS.get(key)
            if layout is None:
                layout = _LAYOUTS[key] = PromptLayout.build(self.task, load_tokenizer(self.model))
        return layout

    def __call__(self, text):
        self._layout().encode(text)
        return text


class PrefixCachedModelHandler(ModelHandler[str, PredictionResult, ServedClassifier]):
    """A `ModelHandler` over `PrefixClassifier`; examples are texts, inferences `Prediction`s.

    Args:
        task: a `TaskSpec` or a task YAML path (read at construction).
        model: model spec (default: the task's, else ``embedded``); RunInference's model
            updates (`update_model_path`) replace it.
        dtype, threads: as for `PrefixClassifier.load`.
        batch_size: rows per forward pass; also the default `max_batch_size`.
        verify: cached-vs-full self-check at load.
        validate_texts: validate each text in a preprocessing step (see the module doc).
        min_batch_size, max_batch_size, max_batch_duration_secs, max_batch_weight,
        element_size_fn, large_model, model_copies, env_vars: Beam's `ModelHandler` arguments.
    """

    def __init__(self, *, task: TaskSpec | str, model: str | None = None, dtype: str = "float32",
                 threads: int | None = None, batch_size: int = 16, verify: bool = True,
                 validate_texts: bool = True, min_batch_size: int = 1, max_batch_size: int | None = None,
                 **kwargs):
        super().__init__(min_batch_size=min_batch_size, max_batch_size=max_batch_size or batch_size, **kwargs)
        self._task = task if isinstance(task, TaskSpec) else TaskSpec.from_yaml(task)
        self._model = model or self._task.model or EMBEDDED
        self._dtype, self._threads, self._verify = dtype, threads, verify
        self._batch_size = batch_size
        self._validate_texts = validate_texts

    def load_model(self) -> ServedClassifier:
        return ServedClassifier(PrefixClassifier.load(
            self._task, self._model, dtype=self._dtype, threads=self._threads, batch_size=self._batch_size,
            verify=self._verify))

    def update_model_path(self, model_path: Optional[str] = None):
        """Use `model_path` from the next `load_model` on (RunInference's model updates); the
        load that follows fails loudly (`ModelLoadError`) when the path is not a model."""
        if model_path:
            self._model = model_path

    def validate_inference_args(self, inference_args: Optional[dict[str, Any]]):
        if inference_args:
            raise ValueError(f"PrefixCachedModelHandler takes no inference_args (got {sorted(inference_args)}); "
                             f"task settings go in the task file or the constructor")

    def get_preprocess_fns(self) -> Iterable:
        return [TextValidator(self._task, self._model)] if self._validate_texts else []

    def run_inference(self, batch: Sequence[str], model: ServedClassifier,
                      inference_args: Optional[dict[str, Any]] = None) -> Iterable[PredictionResult]:
        self.validate_inference_args(inference_args)
        predictions = model.classify(list(batch))
        model_id = model.model_id()
        return [PredictionResult(example, pred, model_id=model_id) for example, pred in zip(batch, predictions)]

    def get_metrics_namespace(self) -> str:
        return "beam_prefix"
