"""Progress lines while a batch runs (#63): a routed run printed nothing for over 8 minutes
because a line was written only when a batch finished. Now a worker's log gets a line at
least every `every_s` seconds of wall time while rows are in flight, and none while idle."""

from __future__ import annotations

import logging
import threading
import time

from beam_prefix.beam.metrics import ProgressLog


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "beam_prefix.beam.metrics"]


def test_a_long_batch_writes_a_line_every_period_and_an_idle_worker_none(caplog):
    caplog.set_level(logging.INFO, logger="beam_prefix.beam.metrics")
    log = ProgressLog("Classify[support]", every_rows=1000, every_s=0.4)
    with log.running(48):
        time.sleep(1.5)
    log.add(48, 1.5)
    during = _lines(caplog)
    beats = [line for line in during if "rows in a batch running for" in line]
    assert 2 <= len(beats) <= 4, during
    assert beats[0].startswith("Classify[support]: 0 rows done, 48 rows in a batch running for")
    time.sleep(1.2)  # idle: nothing in flight, nothing written
    assert _lines(caplog) == during


def test_batches_of_several_threads_are_counted_together(caplog):
    caplog.set_level(logging.INFO, logger="beam_prefix.beam.metrics")
    log = ProgressLog("Extract[fields]", every_rows=1000, every_s=0.4)

    def batch():
        with log.running(10):
            time.sleep(1.0)

    threads = [threading.Thread(target=batch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert any("30 rows in a batch running for" in line for line in _lines(caplog)), _lines(caplog)
