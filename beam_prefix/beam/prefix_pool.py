"""`PrefixPool`: one step's prefix caches in a worker process (one engine per task), bounded.

Each task's engine (a classifier or an extractor: its prompt layout, its read-only prefix
cache) is built on first use, once however many threads ask for it at the same time
(builds run one at a time, so a burst of first uses does not run many CPU-heavy builds at
once), and shared by every thread (each runs through its own fork). When the pool's prefix
caches pass `max_bytes`, the least recently used tasks are dropped; a dropped task is
rebuilt, with identical results, on its next use. A fork still running keeps its prefix
alive until it is done, so eviction never pulls a prefix from under a running batch.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

from beam_prefix.engines.prefix_engine import PrefixEngine

__all__ = ["PrefixPool", "PoolUse", "DEFAULT_MAX_PREFIX_CACHE_MB"]

# Sized for a 2 GB worker: the embedded model takes ~0.55 GB in fp32, its activations at
# batch 16 a few hundred MB; a 280-token prefix is ~6 MB, Banking77's 3,000 tokens ~64 MB.
DEFAULT_MAX_PREFIX_CACHE_MB = 512.0


@dataclasses.dataclass(frozen=True)
class PoolUse:
    """What one `PrefixPool.get` did."""

    engine: PrefixEngine
    built: bool  # False: served from the pool (a hit)
    evicted: int  # tasks dropped to make room
    pool_bytes: int  # the pool's prefix bytes afterwards


class PrefixPool:
    """Task key -> base engine, least recently used first out past `max_bytes`.

    Args:
        max_bytes: the bound on the summed prefix-cache bytes; the task just built stays
            even when it alone is larger.
    """

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, PrefixEngine] = collections.OrderedDict()
        self._build_lock = threading.Lock()
        self.builds = self.hits = self.evictions = 0
        self.peak_bytes = 0

    def _bytes(self) -> int:
        return sum(c.prefix_cache.nbytes for c in self._entries.values())

    def get(self, key: str, build: Callable[[], PrefixEngine]) -> PoolUse:
        """The engine for `key`, built with `build()` if the pool lacks it."""
        with self._lock:
            found = self._hit(key)
            if found is not None:
                return found
        # one build at a time (each is CPU-heavy); lookups of built tasks go on meanwhile
        with self._build_lock:
            with self._lock:
                found = self._hit(key)  # built by another thread while this one waited
                if found is not None:
                    return found
            engine = build()
            with self._lock:
                self._entries[key] = engine
                self.builds += 1
                evicted = 0
                while self._bytes() > self.max_bytes and len(self._entries) > 1:
                    self._entries.popitem(last=False)
                    evicted += 1
                self.evictions += evicted
                size = self._bytes()
                self.peak_bytes = max(self.peak_bytes, size)
                return PoolUse(engine, built=True, evicted=evicted, pool_bytes=size)

    def _hit(self, key: str) -> PoolUse | None:
        engine = self._entries.get(key)
        if engine is None:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return PoolUse(engine, built=False, evicted=0, pool_bytes=self._bytes())
