"""The torch thread count of a step that did not set one: chosen by measurement.

torch's CPU threads meet at a barrier after every parallel op, and a thread that arrives
first spins there. On a worker whose cores are all the engine's, all of them are fastest;
beside one busy process (the harness's own threads, another step, another process) the
spinning thread takes the CPU the late one needs, and on 2 cores 2 threads ran at a third
of the speed of 1 (benchmarks/results/busy_core.md). No count is right everywhere, and the
load changes during a run, so each worker process measures: its batches alternate between
all cores and one thread until each has been timed twice, then run with the faster (the
median seconds per suffix token of each one's last `window` batches), and now and then a
batch runs with the other to notice when the load changes: after `probe_every` batches,
the gap doubling each time a probe confirms the choice (up to `max_probe_every`), back to
`probe_every` when one changes it, so a steady worker spends few batches on the slower
count. A probe's time replaces its count's older ones (they were taken under another
load); the chosen count is timed on every batch, so a choice that got slower is left as
soon as its median passes the other's. This is how Beam's `BatchElements` picks a batch size: by timing what it runs.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

__all__ = ["ThreadChoice"]


class ThreadChoice:
    """One worker process's choice between all cores and one thread (thread-safe).

    Args:
        most: all cores: torch's own count in this process before any step set one.
        probe_every: batches between the first measurements and the first probe of the
            count not chosen (the gap doubles while probes confirm the choice).
        max_probe_every: the longest gap.
        window: batches per count whose median decides.
    """

    def __init__(self, most: int, *, probe_every: int = 16, max_probe_every: int = 256, window: int = 3):
        self.candidates = (most, 1) if most > 1 else (1,)
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self._costs = {c: deque(maxlen=window) for c in self.candidates}
        self._gap = probe_every
        self._next_probe = None  # the batch number of the next probe, once measured
        self._last_best = None
        self._probes = {c: 0 for c in self.candidates}  # probes picked and not yet recorded
        self._batches = 0
        self._lock = threading.Lock()

    def pick(self) -> int:
        """The thread count for the next batch."""
        if len(self.candidates) == 1:  # one core (or torch set to one thread): nothing to choose or probe
            return self.candidates[0]
        with self._lock:
            self._batches += 1
            unmeasured = self._unmeasured()
            if unmeasured is not None:
                return unmeasured
            best = self._best()
            if self._last_best is not None and best != self._last_best:
                self._gap = self.probe_every  # the load changed: look again soon
                self._next_probe = self._batches + self._gap
            elif self._next_probe is None:
                self._next_probe = self._batches + self._gap
            self._last_best = best
            if self._batches >= self._next_probe:
                self._gap = min(2 * self._gap, self.max_probe_every)
                self._next_probe = self._batches + self._gap
                others = [c for c in self.candidates if c != best]
                probe = others[self._batches % len(others)]
                self._probes[probe] += 1
                return probe
            return best

    def record(self, threads: int, seconds: float, tokens: int) -> None:
        """A batch run with `threads` took `seconds` for `tokens` suffix tokens."""
        if threads in self._costs and tokens > 0 and seconds > 0:
            with self._lock:
                if self._probes[threads]:  # a probe: its count's older times are from another load
                    self._probes[threads] -= 1
                    self._costs[threads].clear()
                self._costs[threads].append(seconds / tokens)

    def chosen(self) -> int | None:
        """The count now preferred, None while still measuring."""
        with self._lock:
            return None if self._unmeasured() is not None else self._best()

    def _unmeasured(self) -> int | None:
        """While first measuring (each count timed twice before any choice): the count to
        time next; None once measured (later probes may leave a count one time only)."""
        if self._next_probe is None:
            for count in self.candidates:
                if len(self._costs[count]) < 2:
                    return count
        return None

    def _best(self) -> int:
        return min(self.candidates, key=lambda c: statistics.median(self._costs[c]))
