"""What runs on a worker for every prefix-cached step: the model holder and the row discipline.

`ModelHolder` is the per-process object shared through one `apache_beam.utils.shared.Shared`
handle: one load of each (model, dtype, device) however many steps and threads use it, and
for each step its own pool of base engines (one per task, built and self-checked once,
read-only; `beam_prefix.beam.prefix_pool`), bounded by that step's `max_prefix_cache_mb`.

`PrefixStepDoFn` is the row discipline: `setup()` forks its own engine from the pool (under
shared-prefix attention a fork holds no state between calls; on the expanded cache it has
its own working cache, which no other thread touches); `process()` takes a list of rows
(from `BatchElements`), validates each row, runs the good ones in one engine call
(retried row by row if that call fails) and emits every row exactly once: to the main
output or to ``failed`` with a reason and a stage. The kinds (`dofn.PrefixCachedClassifyDoFn`,
`extract_transform.ExtractFieldsDoFn`) say how to call their engine and what a result becomes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable

import apache_beam as beam
import torch
from apache_beam.utils import shared

from beam_prefix.errors import RowError
from beam_prefix.beam.metrics import ProgressLog, StepMetrics
from beam_prefix.model.loading import LoadedModel, load_model, set_torch_threads
from beam_prefix.beam.prefix_pool import PoolUse, PrefixPool
from beam_prefix.beam.thread_choice import ThreadChoice
from beam_prefix.beam.step import FAILED_TAG, StepConfig, as_dict, failed_record, stamp, text_of, unstamp
from beam_prefix.beam.step import row_config as row_config_of

__all__ = ["ModelHolder", "PrefixStepDoFn"]

_LOGGER = logging.getLogger(__name__)

# One handle per process: every DoFn that refers to it (any step, any thread) shares
# the models acquired through it, keyed by tag (model, dtype, device).
_MODEL_HANDLE = shared.Shared()
# torch's own count before any step set one (all cores): a step without `threads` chooses
# between it and one thread by timing its batches (`thread_choice`), one choice per process
# (torch's count is per process), even after another step in this process set its own
_DEFAULT_THREADS = torch.get_num_threads()
THREADS = ThreadChoice(_DEFAULT_THREADS)


class ModelHolder:
    """The shared per-process object for one (model, dtype, device): the model, and each
    step's pool of base engines (one per task, bounded by that step's own
    `max_prefix_cache_mb`)."""

    loads = 0  # model loads in this process (tests count them)
    last: "ModelHolder | None" = None

    def __init__(self, config: StepConfig, loaded: LoadedModel | None = None):
        type(self).last = self
        self.prefix_builds = 0
        self.forks = 0
        if loaded is None:  # benchmarks hand in the model they already hold
            type(self).loads += 1
            loaded = load_model(config.model, dtype=config.dtype, threads=config.threads, device=config.device)
        self.loaded = loaded
        self._lock = threading.Lock()
        self.pools: dict[str, PrefixPool] = {}  # per step
        self._task_names: set[str] = set()
        self._progress: dict[str, ProgressLog] = {}
        # per step: start-up costs not yet reported as metrics (setup() runs outside a
        # bundle, where Beam does not record metrics, so the step's next process() reports
        # them, under that step's name)
        self._startup: dict[str, list[dict[str, float]]] = {}
        self._model_load_s = loaded.load_s

    def pool(self, step: str, config: StepConfig) -> PrefixPool:
        """Step `step`'s pool (each step has its own, bounded by its config): keyed by the
        bound too, so a later pipeline in this process with a step of the same name but
        another bound gets its own, not the first one's."""
        bound = int(config.max_prefix_cache_mb * 2**20)
        key = f"{step}|{bound}"
        with self._lock:
            if key not in self.pools:
                self.pools[key] = PrefixPool(bound)
            return self.pools[key]

    def engine_for(self, step: str, config: StepConfig):
        """A fork of the task's engine (its prefix built once per process and step, pooled)."""
        return self.use(step, config).engine.fork()

    def use(self, step: str, config: StepConfig) -> PoolUse:
        """Step `step`'s pool entry for the task of `config`, built (and self-checked) if absent."""
        def build():
            base = config.build_engine(self.loaded)
            with self._lock:
                self.prefix_builds += 1
                self._startup.setdefault(step, []).append({"model_load_s": self._model_load_s, **base.startup})
                self._model_load_s = 0.0  # one load per process, however many tasks
            return base

        used = self.pool(step, config).get(config.task_key, build)
        with self._lock:
            self.forks += 1
        return used

    def task_metric_name(self, key: str, limit: int) -> str:
        """`key`, or ``other`` once `limit` other keys have their own metrics in this process."""
        with self._lock:
            if key in self._task_names or len(self._task_names) < limit:
                self._task_names.add(key)
                return key
        return "other"

    def take_startup(self, step: str) -> list[dict[str, float]]:
        """Step `step`'s start-up reports not yet taken (each is taken once, by one of that
        step's DoFn instances, so Beam files it under that step)."""
        with self._lock:
            return self._startup.pop(step, [])

    def progress_for(self, name: str) -> ProgressLog:
        """One progress line per step and worker process, fed by all its threads."""
        with self._lock:
            return self._progress.setdefault(name, ProgressLog(name))


class PrefixStepDoFn(beam.DoFn):
    """The row discipline every prefix-cached step shares: a batch's rows are validated one
    by one, run in one engine call (retried row by row if the call fails), and each row is
    emitted exactly once, to the main output or to `failed` with a reason and a stage.

    Subclasses say how to run the engine (`_call`) and what a result becomes (`_emit`)."""

    def __init__(self, config: StepConfig, *, step_name: str):
        self.config = config
        self.step_name = step_name
        self._engine = None

    def setup(self):
        self._attach(self.config.task.name)
        self._engine = self._holder.engine_for(self.step_name, self.config)

    def _attach(self, name: str) -> None:
        """The process's shared model holder, this instance's metrics and progress line."""
        self._holder = _MODEL_HANDLE.acquire(lambda: ModelHolder(self.config), tag=self.config.model_tag)
        self._metrics = StepMetrics()
        self._progress = self._holder.progress_for(f"{self.step_name}[{name}]")

    def process(self, batch: Iterable[Any]):
        """Elements are rows, or `Stamped` rows (whose outputs then carry their timestamp)."""
        yield from self._run_rows(self._engine, self.config, batch)

    def _call(self, engine, encoded: list) -> list:
        raise NotImplementedError

    def _emit(self, engine, config: StepConfig, row: dict, result, timestamp) -> Iterable[Any]:
        """The output of one row's result; returns nothing for a failed row (`_failed`)."""
        raise NotImplementedError

    def _run_rows(self, engine, config: StepConfig, batch: Iterable[Any]):
        """Validate, run (one call) and emit every row of `batch` once, with `engine` (a
        fork of the task's engine) and the task's `config`."""
        for report in self._holder.take_startup(self.step_name):
            self._metrics.report_startup(report)
        good, encoded = [], []  # good: (row, its timestamp or None, the config for its columns)
        for element in batch:
            element, ts = unstamp(element)
            row = as_dict(element, config.text_column)
            try:
                row_config = row_config_of(config, row)
                encoded.append(engine.encode(text_of(config, row)))
                good.append((row, ts, row_config))
            except RowError as e:
                yield self._failed(config, row, e.reason, str(e), "validate", ts)
            except Exception as e:  # whatever else one row raises fails that row, not the bundle
                yield self._failed(config, row, "invalid_row", f"{type(e).__name__}: {e}", "validate", ts)
        if not good:
            return
        threads = config.threads or THREADS.pick()  # this step's count (torch's is per process)
        set_torch_threads(threads)
        start = time.perf_counter()
        with self._progress.running(len(encoded)):
            try:
                results = self._call(engine, encoded)
            except Exception as e:  # one bad batch: retry row by row, fail only what still fails
                _LOGGER.warning("%s: batch of %d rows failed (%s); retrying row by row",
                                self.step_name, len(good), e)
                self._metrics.model_retries.inc()
                results = []
                for enc in encoded:
                    try:
                        results.append(self._call(engine, [enc])[0])
                    except Exception as row_error:
                        results.append(row_error)
        elapsed = time.perf_counter() - start
        if not config.threads:
            THREADS.record(threads, elapsed, sum(len(e.suffix_ids) for e in encoded))
        self._metrics.batch_size.update(len(good))
        self._metrics.batch_latency.update(int(elapsed * 1e6))
        for (row, ts, row_config), result in zip(good, results):
            if isinstance(result, Exception):
                reason = result.reason if isinstance(result, RowError) else "model_error"
                yield self._failed(config, row, reason, f"{type(result).__name__}: {result}", "model", ts)
                continue
            self._metrics.prefix_tokens_reused.inc(engine.prefix_length)
            if result.truncated:
                self._metrics.rows_truncated.inc()
            yield from self._emit(engine, row_config, row, result, ts)
        self._progress.add(sum(not isinstance(r, Exception) for r in results), elapsed)

    def teardown(self):
        self._engine = None
        self._holder = None

    def _failed(self, config: StepConfig, row: dict, reason: str, error: str, stage: str, timestamp=None):
        self._metrics.rows_failed.inc()
        record = failed_record(row, id_value=row.get(config.id_column) if config.id_column else None,
                               reason=reason, error=error, stage=stage)
        return beam.pvalue.TaggedOutput(FAILED_TAG, stamp(record, timestamp))
