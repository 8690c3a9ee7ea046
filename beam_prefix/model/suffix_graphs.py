"""The suffix pass at a few fixed shapes, replayed as CUDA graphs on a GPU.

On a GPU the engine's suffix pass is launch-bound: each of the model's layers is a dozen
small kernels, each launched from Python, and a batch of 64 short rows keeps the device a
fraction of the time busy. A CUDA graph records the kernels of one pass once and replays
them with one launch, but only for fixed shapes and with no host synchronisation inside.

`SuffixGraphs` gives the suffix pass both:

* **Buckets.** A step of ``B`` rows of width ``Q`` is padded to ``bucket(B)`` rows of
  ``bucket(Q)`` columns (`BUCKETS`: under 1.5x each way up to 4,096). The pad columns are no tokens:
  the masks let each see only itself and no real token sees them (as for any padded step);
  the extra rows are all pad. The padded batch runs *dense* (`attention.Packing.dense_of`):
  every column goes through the model, so its shapes follow from the bucket alone and
  nothing is asked of the device about which columns are real (the packed path's one
  `nonzero`). Results at the real columns equal the packed path's within float rounding
  (tested on the four tiny architectures); the pad columns are zeroed on the way out.
* **Graphs.** With ``capture=True`` (a CUDA model) each bucket's pass is recorded once, on
  first use, into a graph whose inputs (ids, positions, masks) and outputs are fixed
  tensors; a call copies its inputs in, replays, and copies the outputs out. Graphs share
  one memory pool and are replayed one at a time, under this object's lock: it is the one
  mutable thing the threads of an engine share, and the lock is what makes sharing it safe.
  If recording fails (an operation that cannot be captured), the reason is logged and kept
  in `failure`, and the buckets run without graphs from then on: slower, never wrong.

Only one-pass steps with nothing earlier in the call take this path (classification: the
head's features, first-token and exhaustive label scores); pruned search rounds and
decoding steps attend to the call's earlier tokens, whose count changes every step, and run
the packed path. A prefix with a sliding-window layer is not captured (its prefix part asks
the host which columns a window hides) but still runs the buckets, eagerly. On the CPU the
buckets run eagerly too (``capture=False``): that is how they are tested here, where no
GPU is; the packed path stays the CPU's default, since pad columns cost real arithmetic
there.
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import Callable

import torch

__all__ = ["BUCKETS", "SUFFIX_PASSES", "bucket", "SuffixGraphs", "for_device", "check_suffix_pass",
           "check_suffix_pass_name"]

SUFFIX_PASSES = ("packed", "buckets", "graphs")

_LOGGER = logging.getLogger(__name__)

# rows and columns are rounded up to the next of these (then to the next multiple of the last)
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
MAX_GRAPHS = 64  # captured graphs per prefix; past it, further buckets run eagerly


def bucket(n: int) -> int:
    """The padded size of a dimension of `n` (>= 1): the next of `BUCKETS` (under 1.5x `n`),
    past them the next multiple of the last."""
    if n < 1:
        raise ValueError(f"a step needs at least one row and one column, got {n}")
    if n > BUCKETS[-1]:
        return -(-n // BUCKETS[-1]) * BUCKETS[-1]
    return BUCKETS[bisect.bisect_left(BUCKETS, n)]


def check_suffix_pass_name(suffix_pass: str) -> None:
    """Refuse a suffix pass that does not exist."""
    if suffix_pass not in SUFFIX_PASSES:
        raise ValueError(f"suffix_pass must be one of {SUFFIX_PASSES}, got {suffix_pass!r}")


def check_suffix_pass(suffix_pass: str, device: str) -> None:
    """Refuse, where a step is built, a suffix pass that does not exist, or graphs on ``cpu``
    (the device as asked for; `SuffixGraphs` refuses a model placed off CUDA)."""
    check_suffix_pass_name(suffix_pass)
    if suffix_pass == "graphs" and device == "cpu":
        raise ValueError("suffix_pass='graphs' records CUDA graphs: it needs device='cuda', 'cuda:N' or 'auto'")


def for_device(suffix_pass: str, requested: str, placed: torch.device) -> str:
    """The suffix pass to run on a model placed on `placed` when `requested` was asked for:
    ``graphs`` with ``auto`` on a machine without a GPU runs ``packed``, and says so (graphs
    asked for elsewhere than CUDA are refused instead: `check_suffix_pass`, `SuffixGraphs`)."""
    if suffix_pass == "graphs" and requested == "auto" and torch.device(placed).type != "cuda":
        _LOGGER.info("suffix_pass='graphs': device='auto' put the model on %s, so its batches run packed", placed)
        return "packed"
    return suffix_pass


class _Graph:
    """One bucket's captured pass: its fixed input tensors, the graph, its fixed outputs."""

    def __init__(self, graph, inputs: dict, outputs: tuple):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class SuffixGraphs:
    """Buckets and (on CUDA) graphs for the suffix passes over one prefix.

    Args:
        capture: record each bucket's pass as a CUDA graph (the prefix's device must be CUDA).
        max_graphs: graphs kept at most; buckets past it run eagerly.
    """

    def __init__(self, device: torch.device, *, capture: bool, max_graphs: int = MAX_GRAPHS):
        if capture and torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this model is on {device}")
        self.device = torch.device(device)
        self.capture = capture
        self.max_graphs = max_graphs
        self._lock = threading.Lock()
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self.shapes: set[tuple] = set()  # every bucket key run so far (captured or not)
        self.failure: str | None = None  # why recording failed, if it did (graphs are then off)

    @property
    def captured(self) -> int:
        """How many graphs are recorded."""
        return len(self._graphs)

    def run(self, key: tuple, inputs: dict[str, torch.Tensor], run_pass: Callable[..., tuple],
            capturable: bool) -> tuple[torch.Tensor, ...]:
        """`run_pass(**inputs)` (a tuple of tensors), replayed from this `key`'s graph
        where one may be captured (`capturable`: the pass has no host synchronisation),
        else run as it is. Returns tensors the caller owns (copies of a graph's outputs)."""
        with self._lock:
            self.shapes.add(key)
        if not (self.capture and capturable):  # eager: nothing shared is touched, no lock held
            return run_pass(**inputs)
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None and self.capture and len(self._graphs) < self.max_graphs:
                try:
                    graph = self._graphs[key] = self._record(inputs, run_pass)
                except Exception as e:  # e.g. an op that cannot be captured: the buckets, eagerly, from now on
                    self.capture, self.failure = False, f"{type(e).__name__}: {e}"
                    _LOGGER.warning("recording a CUDA graph of the suffix pass failed (%s); running its "
                                    "buckets without graphs", self.failure)
            if graph is None:
                return run_pass(**inputs)
            for name, tensor in inputs.items():
                graph.inputs[name].copy_(tensor)
            graph.graph.replay()
            return tuple(out.clone() for out in graph.outputs)

    def _record(self, inputs: dict, run_pass: Callable[..., tuple]) -> _Graph:
        """Warm the pass up on a side stream (lazy allocations, library handles), then
        capture it into a new graph in the shared pool."""
        static = {name: tensor.clone() for name, tensor in inputs.items()}
        with torch.cuda.device(self.device):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    run_pass(**static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = run_pass(**static)
        _LOGGER.info("captured a CUDA graph of the suffix pass for %s", tuple(t.shape for t in static.values()))
        return _Graph(graph, static, tuple(outputs))
