"""Beam metrics and the per-worker progress log line.

All metrics live in the `beam_prefix` namespace; names carry their unit.
"""

from __future__ import annotations

import logging
import threading
import time

from apache_beam.metrics import Metrics

__all__ = ["StepMetrics", "COUNTERS", "DISTRIBUTIONS", "ProgressLog", "NAMESPACE", "STARTUP_METRICS"]

NAMESPACE = "beam_prefix"
_LOGGER = logging.getLogger(__name__)


class StepMetrics:
    """Counters and distributions a prefix-cached step's DoFn updates (each attribute is
    the metric of the same name in `COUNTERS` / `DISTRIBUTIONS`)."""

    def __init__(self):
        for attribute, name in COUNTERS.items():
            setattr(self, attribute, Metrics.counter(NAMESPACE, name))
        for attribute, name in DISTRIBUTIONS.items():
            setattr(self, attribute, Metrics.distribution(NAMESPACE, name))
        # once per prefix cache built (per worker process and task): what start-up cost
        self.startup = {name: Metrics.distribution(NAMESPACE, metric) for name, metric in STARTUP_METRICS.items()}

    def prefix_use(self, used, *, task: str, rows: int) -> None:
        """One routed batch: a pool hit or build (`prefix_pool.PoolUse`), for task `task`
        (its counters: ``task_rows:<task>``, ``task_batches:<task>``, ``task_builds:<task>``)."""
        (self.prefix_builds if used.built else self.prefix_hits).inc()
        if used.evicted:
            self.prefix_evictions.inc(used.evicted)
        self.prefix_pool_bytes.update(used.pool_bytes)
        Metrics.counter(NAMESPACE, f"task_rows:{task}").inc(rows)
        Metrics.counter(NAMESPACE, f"task_batches:{task}").inc()
        if used.built:
            Metrics.counter(NAMESPACE, f"task_builds:{task}").inc()

    def report_startup(self, report: dict[str, float]) -> None:
        """Record one prefix build's start-up costs (s as ms, ms per row as us)."""
        for name, value in report.items():
            if name in self.startup:
                self.startup[name].update(int(round(value * 1e3)))


# attribute -> counter name
COUNTERS = {
    "rows_classified": "rows_classified",
    "rows_embedded": "rows_embedded",
    "rows_failed": "rows_failed",
    "rows_truncated": "rows_truncated",
    "prefix_tokens_reused": "prefix_tokens_reused",
    "suffix_tokens_computed": "suffix_tokens_computed",  # every token run per row: the suffix and its label tokens
    "label_tokens_computed": "label_tokens_computed",  # of those, label-trie tokens (what pruned search saves)
    "model_retries": "batches_retried_row_by_row",
    # routed steps (beam_prefix.beam.routing): the worker's prefix pool, per batch
    "prefix_builds": "prefix_builds",
    "prefix_hits": "prefix_hits",
    "prefix_evictions": "prefix_evictions",
}
# attribute -> distribution name
DISTRIBUTIONS = {"batch_size": "batch_size_rows", "batch_latency": "batch_latency_micros",
                 "prefix_pool_bytes": "prefix_pool_bytes"}

# start-up report keys -> distribution names (`*_s` in ms; `*_ms_per_row` in us)
STARTUP_METRICS = {
    "model_load_s": "startup_model_load_ms",
    "prefix_build_s": "startup_prefix_build_ms",
    "self_check_s": "startup_self_check_ms",
    "cached_ms_per_row": "self_check_cached_us_per_row",
    "full_ms_per_row": "self_check_full_us_per_row",
}


class ProgressLog:
    """Logs `rows done, rows/s, ms/row` every `every_rows` rows or `every_s` seconds.

    One per worker process (shared by its threads), so the line reports the worker.
    """

    def __init__(self, name: str, every_rows: int = 100, every_s: float = 30.0):
        self.name = name
        self.every_rows = every_rows
        self.every_s = every_s
        self._lock = threading.Lock()
        self._start = None
        self._rows = 0
        self._busy_s = 0.0
        self._last_rows = 0
        self._last_t = 0.0

    def add(self, rows: int, busy_s: float) -> None:
        with self._lock:
            now = time.perf_counter()
            if self._start is None:
                self._start = self._last_t = now - busy_s
            self._rows += rows
            self._busy_s += busy_s
            if self._rows - self._last_rows >= self.every_rows or now - self._last_t >= self.every_s:
                elapsed = max(now - self._start, 1e-9)
                _LOGGER.info("%s: %d rows done, %.1f rows/s, %.1f ms/row", self.name, self._rows,
                             self._rows / elapsed, 1e3 * self._busy_s / max(self._rows, 1))
                self._last_rows, self._last_t = self._rows, now
