"""Beam metrics and the per-worker progress log line.

All metrics live in the `beam_prefix` namespace; names carry their unit.
"""

from __future__ import annotations

import contextlib
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
    """Logs `rows done, rows/s, ms/row` every `every_rows` rows or `every_s` seconds, and
    while a batch runs, a line at least every `every_s` seconds of wall time (a batch of
    many rows, or a slow decode, is then told apart from a hung one).

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
        self._in_flight = 0  # rows of the batches running now
        self._since = 0.0  # when the oldest of them started
        self._ticker: threading.Thread | None = None

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

    @contextlib.contextmanager
    def running(self, rows: int):
        """While the block runs a batch of `rows` rows, a daemon thread of this log writes
        a line every `every_s` seconds that nothing else was written."""
        with self._lock:
            now = time.perf_counter()
            if not self._in_flight:
                self._since = now
            if self._start is None:
                self._start = self._last_t = now
            self._in_flight += rows
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name=f"progress {self.name}", daemon=True)
                self._ticker.start()
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= rows

    def _tick(self) -> None:
        while True:
            time.sleep(min(self.every_s, 5.0) / 2)
            with self._lock:
                now = time.perf_counter()
                if self._in_flight and now - self._last_t >= self.every_s:
                    _LOGGER.info("%s: %d rows done, %d rows in a batch running for %.0f s", self.name,
                                 self._rows, self._in_flight, now - self._since)
                    self._last_t = now
