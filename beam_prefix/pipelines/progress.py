"""Progress of a long in-process step (a tuning's epochs) on the console.

On a terminal a tqdm bar (steps, rows/s, time left); elsewhere (a log file, CI, a
scheduler) a plain log line at most every `TuningProgress.every_s` seconds and at the end
of each epoch, so a log is readable and not a wall of carriage returns.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["TuningProgress"]


class TuningProgress:
    """Reports `tune_model(progress=...)` calls: (epoch, step, steps in the epoch, rows).

    Args:
        epochs: the tuning's epochs (for the total and the time left).
        logger: where the plain lines go.
        bar: a tqdm bar (default: when stderr is a terminal).
        every_s: the least time between two plain lines within an epoch.
    """

    def __init__(self, *, epochs: int, logger: logging.Logger, bar: bool | None = None, every_s: float = 15.0):
        self.epochs, self.logger, self.every_s = epochs, logger, every_s
        self.bar = sys.stderr.isatty() if bar is None else bar
        self._tqdm = None
        self._start = self._last = time.monotonic()
        self._rows = 0
        self._steps_done = 0

    def __call__(self, epoch: int, step: int, steps: int, rows: int) -> None:
        self._rows += rows
        self._steps_done += 1
        total = self.epochs * steps
        elapsed = time.monotonic() - self._start
        rate = self._rows / elapsed if elapsed > 0 else 0.0
        left = (total - self._steps_done) * elapsed / self._steps_done
        if self.bar:
            if self._tqdm is None:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, unit="step", desc="tuning", dynamic_ncols=True)
            self._tqdm.set_postfix_str(f"epoch {epoch}/{self.epochs}, {rate:.1f} rows/s", refresh=False)
            self._tqdm.update(1)
            return
        now = time.monotonic()
        if step == steps or now - self._last >= self.every_s:
            self._last = now
            self.logger.info("tuning: epoch %d/%d, step %d/%d, %.1f rows/s, about %.0f s left", epoch, self.epochs,
                             step, steps, rate, left)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
