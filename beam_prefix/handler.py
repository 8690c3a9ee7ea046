"""`PrefixCachedModelHandler`: the same cached scoring behind Beam's `RunInference`.

    from apache_beam.ml.inference.base import RunInference
    texts | RunInference(PrefixCachedModelHandler(task=task, model="embedded"))

`load_model` loads the model and builds the prefix cache (RunInference shares the result
between the threads of a worker). `run_inference` may then be called from several
threads at once on that one object, so each thread classifies through its own fork
(shared weights and prefix; with the expanded engine its own working cache) kept in a
thread-local.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable, Optional, Sequence

from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from beam_prefix.classifier import PrefixClassifier
from beam_prefix.model import EMBEDDED
from beam_prefix.task import TaskSpec

__all__ = ["PrefixCachedModelHandler"]


class PrefixCachedModelHandler(ModelHandler[str, PredictionResult, PrefixClassifier]):
    """A `ModelHandler` over `PrefixClassifier`; examples are texts, inferences `Prediction`s.

    Args:
        task: a `TaskSpec` or a task YAML path (read at construction).
        model: model spec (default: the task's, else ``embedded``).
        dtype, threads: as for `PrefixClassifier.load`.
        batch_size: rows per forward pass; also RunInference's max batch size.
        verify: cached-vs-full self-check at load.
    """

    def __init__(self, *, task: TaskSpec | str, model: str | None = None, dtype: str = "float32",
                 threads: int | None = None, batch_size: int = 16, verify: bool = True,
                 min_batch_size: int = 1):
        super().__init__()
        self._task = task if isinstance(task, TaskSpec) else TaskSpec.from_yaml(task)
        self._model = model or self._task.model or EMBEDDED
        self._dtype, self._threads, self._verify = dtype, threads, verify
        self._batch_size, self._min_batch_size = batch_size, min_batch_size
        self._local = threading.local()

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_local", None)  # thread-locals are per process
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def load_model(self) -> PrefixClassifier:
        return PrefixClassifier.load(self._task, self._model, dtype=self._dtype, threads=self._threads,
                                     batch_size=self._batch_size, verify=self._verify)

    def _for_thread(self, model: PrefixClassifier) -> PrefixClassifier:
        forks = getattr(self._local, "forks", None)
        if forks is None:
            forks = self._local.forks = weakref.WeakKeyDictionary()
        clf = forks.get(model)
        if clf is None:
            clf = forks[model] = model.fork()
        return clf

    def run_inference(self, batch: Sequence[str], model: PrefixClassifier,
                      inference_args: Optional[dict[str, Any]] = None) -> Iterable[PredictionResult]:
        predictions = self._for_thread(model).classify(list(batch))
        return [PredictionResult(example, pred, model_id=model.model_id)
                for example, pred in zip(batch, predictions)]

    def batch_elements_kwargs(self):
        return {"min_batch_size": self._min_batch_size, "max_batch_size": self._batch_size}

    def get_metrics_namespace(self) -> str:
        return "beam_prefix"

    def share_model_across_processes(self) -> bool:
        return False
