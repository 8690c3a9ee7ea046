"""`PrefixCachedModelHandler`: the same cached engines behind Beam's `RunInference`.

    from apache_beam.ml.inference.base import RunInference
    texts | RunInference(PrefixCachedModelHandler(task="support_tickets", model="embedded"))

A classification task's inferences are `Prediction`s; an extraction task's (``kind:
extract``, decoded or read by a trained head) are `Extraction`s, from the same engine
`ExtractFields` runs. `load_model` loads the model and builds the prefix cache;
RunInference shares the result between the threads of a worker (or, with
``large_model=True`` / ``model_copies``, between its processes through
`MultiProcessShared`). The loaded object is a `ServedClassifier` or `ServedExtractor`:
`infer` may be called from many threads at once, each running through its own fork
(shared weights and prefix; with the expanded engine its own working cache), and it
pickles nothing but texts and results when it lives in another process.

Bad texts fail alone: the handler's preprocessing step validates and encodes each text
(its own tokenizer, no model), so under ``RunInference(...).with_exception_handling()`` a
``None`` or an over-budget text goes to ``failed_preprocessing`` with its `RowError` and
never fails the good texts batched with it. A valid text travels on as a `ValidText`
carrying its encoding, so it is tokenized once; results carry the text itself.

Keyed examples: Beam's ``KeyedModelHandler`` refuses a handler that has a preprocessing
step (its pre/postprocessing must be on the outer handler), so keyed use has its own
handler, `KeyedPrefixCachedModelHandler`: ``(key, text)`` in, ``(key, PredictionResult)``
out, each bad text failing alone in the same way. Beam's own wrapper works on a handler
built with ``validate_texts=False`` (each text is then validated in the batch: a bad
one fails its batch, as a model error would).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import sys
import threading
from typing import Any, Iterable, Optional, Sequence

from apache_beam.ml.inference.base import KeyedModelHandler, MaybeKeyedModelHandler, ModelHandler, PredictionResult

from beam_prefix.engines.classifier import PrefixClassifier
from beam_prefix.engines.extractor import Extractor
from beam_prefix.model.loading import EMBEDDED, check_device, load_tokenizer
from beam_prefix.model.suffix_graphs import check_suffix_pass
from beam_prefix.tasks.extract_task import ExtractionSpec, load_task
from beam_prefix.tasks.prompt import EncodedText, PromptLayout
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.tasks.trained_head import dtype_for

__all__ = ["PrefixCachedModelHandler", "KeyedPrefixCachedModelHandler", "ServedClassifier", "ServedExtractor",
           "TextValidator", "ValidText"]


@dataclasses.dataclass(frozen=True)
class ValidText:
    """A text that passed validation, with its encoding and the ``(model, task)`` it was
    encoded for (after a model update, `run_inference` encodes it again)."""

    text: str
    encoded: EncodedText
    key: str


def _key(model: str, task: TaskSpec | ExtractionSpec) -> str:
    return hashlib.sha256(f"{model}|{task!r}".encode("utf-8")).hexdigest()[:16]


class _Served:
    """One base engine, run through per-thread forks. Only methods cross a process boundary
    (a proxy exposes no attributes), so the model id is a method too."""

    def __init__(self, engine, key: str = ""):
        self.engine = engine
        self._key = key  # the (model, task) whose encodings `ValidText`s may carry here
        self._local = threading.local()

    def _fork(self):
        fork = getattr(self._local, "fork", None)
        if fork is None:
            fork = self._local.fork = self.engine.fork()
        return fork

    def _encoded(self, fork, texts: Sequence) -> list[EncodedText]:
        """Texts (or `ValidText`s) encoded; a `ValidText` encoded for this model and task is
        not tokenized again."""
        return [(t.encoded if t.key == self._key else fork.encode(t.text)) if isinstance(t, ValidText)
                else fork.encode(t) for t in texts]

    def infer(self, texts: Sequence) -> list:
        """The engine's results for texts (or `ValidText`s), in order."""
        raise NotImplementedError

    def model_id(self) -> str:
        return self.engine.model_id


class ServedClassifier(_Served):
    """What `PrefixCachedModelHandler.load_model` returns for a classification task."""

    @property
    def classifier(self) -> PrefixClassifier:
        return self.engine

    def infer(self, texts: Sequence):
        fork = self._fork()
        return fork.classify_encoded(self._encoded(fork, texts))

    classify = infer


class ServedExtractor(_Served):
    """What `PrefixCachedModelHandler.load_model` returns for an extraction task."""

    @property
    def extractor(self) -> Extractor:
        return self.engine

    def infer(self, texts: Sequence):
        fork = self._fork()
        return fork.extract_encoded(self._encoded(fork, texts))

    extract = infer


# per process: the prompt layout each (task, model) validates texts with
_LAYOUTS: dict[tuple[str, str], PromptLayout] = {}
_LAYOUTS_LOCK = threading.Lock()


class TextValidator:
    """A preprocessing function: returns the text as a `ValidText` (its encoding attached),
    or raises the `RowError` (with its reason) that the classifier would raise for it.
    Loads only the tokenizer, once per process. `keyed`: examples are ``(key, text)``."""

    def __init__(self, task: TaskSpec, model: str, *, keyed: bool = False):
        self.task, self.model, self.keyed = task, model, keyed

    def _layout(self) -> PromptLayout:
        key = (self.model, repr(self.task))
        with _LAYOUTS_LOCK:
            layout = _LAYOUTS.get(key)
            if layout is None:
                layout = _LAYOUTS[key] = PromptLayout.build(self.task, load_tokenizer(self.model))
        return layout

    def __call__(self, example):
        if self.keyed:
            key, text = example
            return key, self._valid(text)
        return self._valid(example)

    def _valid(self, text) -> ValidText:
        return ValidText(text, self._layout().encode(text), _key(self.model, self.task))


class PrefixCachedModelHandler(ModelHandler[str, PredictionResult, ServedClassifier]):
    """A `ModelHandler` over `PrefixClassifier` or `Extractor`; examples are texts,
    inferences `Prediction`s (classification) or `Extraction`s (extraction).

    Args:
        task: a shipped task's name (``support_tickets``, ``ticket_fields_head``, ...), a
            task YAML file's path, a `TaskSpec` or an `ExtractionSpec` (read at construction).
        model: model spec (default: the task's, else ``embedded``); RunInference's model
            updates (`update_model_path`) replace it.
        dtype: as for `PrefixClassifier.load` (default: the precision of the task's head,
            else float32).
        threads: as for `PrefixClassifier.load`.
        device: ``cpu`` (default), ``cuda``, ``cuda:N`` or ``auto``.
        suffix_pass: ``packed`` (default), ``buckets`` or ``graphs`` (CUDA graphs; not with
            ``device="cpu"``; with ``auto`` on a machine without a GPU, packed): docs/scale.md,
            "GPU workers". Classification only: an extraction task takes ``packed``.
        batch_size: rows per forward pass (extraction: rows decoded together); also the
            default `max_batch_size`.
        verify: cached-vs-full self-check at load.
        validate_texts: validate each text in a preprocessing step (see the module doc).
        min_batch_size: Beam's `ModelHandler` argument: the smallest batch.
        max_batch_size: the largest batch (default `batch_size`).
        max_batch_duration_secs: how long to buffer a batch (streaming).
        max_batch_weight: a batch's largest total weight, by `element_size_fn` (where the
            installed Beam's `BatchElements` batches by weight; else refused).
        element_size_fn: an element's weight, for `max_batch_weight`.
        large_model: one copy of the model per machine, shared by its processes
            (`MultiProcessShared`).
        model_copies: that many copies per machine instead.
        env_vars: environment variables set before the model loads.
    """

    def __init__(self, task: TaskSpec | str, *, model: str | None = None, dtype: str | None = None,
                 threads: int | None = None, device: str = "cpu", batch_size: int = 16, verify: bool = True,
                 validate_texts: bool = True, min_batch_size: int = 1, max_batch_size: int | None = None,
                 suffix_pass: str = "packed", max_batch_duration_secs: int | None = None,
                 max_batch_weight: int | None = None, element_size_fn=None, large_model: bool = False,
                 model_copies: int | None = None, env_vars: dict | None = None):
        # Beam's own ModelHandler takes these arguments only from 2.72 on; kept here so that
        # every Beam of setup.py's range (2.70 up) batches and shares the model alike
        super().__init__()
        batching = {"min_batch_size": min_batch_size, "max_batch_size": max_batch_size or batch_size,
                    "max_batch_duration_secs": max_batch_duration_secs, "max_batch_weight": max_batch_weight,
                    "element_size_fn": element_size_fn}
        self._batching = {name: value for name, value in batching.items() if value is not None}
        if "max_batch_weight" in self._batching:
            _check_batch_weight()
        self._env_vars = dict(env_vars or {})
        self._large_model, self._copies = large_model, model_copies
        self._task = load_task(task)
        if isinstance(self._task, ExtractionSpec) and suffix_pass != "packed":
            raise ValueError(f"suffix_pass={suffix_pass!r} is for classification tasks; task {self._task.name!r} "
                             f"extracts fields: leave suffix_pass out")
        self._model = model or self._task.model or EMBEDDED
        dtype = dtype_for([self._task.head], dtype)  # the head's own, else float32
        check_device(device, dtype)
        check_suffix_pass(suffix_pass, device)
        self._dtype, self._threads, self._verify, self._device = dtype, threads, verify, device
        self._suffix_pass = suffix_pass
        self._batch_size = batch_size
        self._validate_texts = validate_texts

    def batch_elements_kwargs(self) -> dict[str, Any]:
        return dict(self._batching)

    def share_model_across_processes(self) -> bool:
        return self._large_model or self._copies is not None

    def model_copies(self) -> int:
        return self._copies or 1

    def load_model(self) -> ServedClassifier | ServedExtractor:
        common = {"dtype": self._dtype, "threads": self._threads, "device": self._device,
                  "batch_size": self._batch_size, "verify": self._verify}
        key = _key(self._model, self._task)
        if isinstance(self._task, ExtractionSpec):
            return ServedExtractor(Extractor.load(self._task, self._model, **common), key=key)
        return ServedClassifier(PrefixClassifier.load(self._task, self._model, suffix_pass=self._suffix_pass,
                                                      **common), key=key)

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
        if self._validate_texts and _wrapped_by_keyed(sys._getframe(1)):
            raise TypeError("KeyedModelHandler(PrefixCachedModelHandler(...)) cannot wrap a handler that "
                            "validates texts in a preprocessing step: use KeyedPrefixCachedModelHandler(task=..., "
                            "model=...) from beam_prefix.handler for (key, text) examples, or "
                            "PrefixCachedModelHandler(..., validate_texts=False) inside Beam's wrapper")
        return [TextValidator(self._task, self._model)] if self._validate_texts else []

    def run_inference(self, batch: Sequence[str], model: ServedClassifier | ServedExtractor,
                      inference_args: Optional[dict[str, Any]] = None) -> Iterable[PredictionResult]:
        self.validate_inference_args(inference_args)
        predictions = model.infer(list(batch))
        model_id = model.model_id()
        return [PredictionResult(example.text if isinstance(example, ValidText) else example, pred, model_id=model_id)
                for example, pred in zip(batch, predictions)]

    def get_metrics_namespace(self) -> str:
        return "beam_prefix"


def _check_batch_weight() -> None:
    """`max_batch_weight` needs a `BatchElements` that takes it; Beam's ModelHandler accepts
    the argument, but no Beam of setup.py's range (up to 2.77) batches by it."""
    from apache_beam.transforms.util import BatchElements
    if "max_batch_weight" not in inspect.signature(BatchElements.__init__).parameters:
        import apache_beam
        raise TypeError(f"max_batch_weight: this Beam's BatchElements ({apache_beam.__version__}) does not "
                        f"batch by weight; leave it out to batch by count (max_batch_size)")


def _wrapped_by_keyed(frame) -> bool:
    """Whether the caller is Beam's (Maybe)KeyedModelHandler being built around a handler
    (its constructor refuses one with preprocessing, in a message that names no way out)."""
    wrapper = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
    return isinstance(wrapper, (KeyedModelHandler, MaybeKeyedModelHandler)) \
        and not isinstance(wrapper, KeyedPrefixCachedModelHandler)


class KeyedPrefixCachedModelHandler(KeyedModelHandler):
    """`PrefixCachedModelHandler` for keyed examples: ``(key, text)`` in, ``(key,
    PredictionResult)`` out. Takes the same arguments; with ``validate_texts`` (default)
    each text is validated and encoded in this handler's own preprocessing step, so under
    ``with_exception_handling()`` a bad one lands alone in ``failed_preprocessing`` (Beam's
    ``KeyedModelHandler`` cannot wrap a handler that has such a step)."""

    def __init__(self, *, validate_texts: bool = True, **kwargs):
        self._inner = PrefixCachedModelHandler(validate_texts=False, **kwargs)
        super().__init__(self._inner)
        self._validate_texts = validate_texts

    def get_preprocess_fns(self) -> Iterable:
        own = [TextValidator(self._inner._task, self._inner._model, keyed=True)] if self._validate_texts else []
        return own + list(super().get_preprocess_fns())
