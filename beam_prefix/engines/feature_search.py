"""Which hidden states a trained head reads, chosen by folds of the training rows.

A head may read the early layers (cheap: the forward exits there), a middle pair, or the
final state (the whole model). Which is best depends on the task and the rows, and the
fold accuracy `head_fitting` already measures tracks held-out accuracy, so the choice is
made by folds: `candidates` lists a few feature sets for a model of ``L`` layers, one
forward reads them all (`union`: the deepest candidate's forward yields every earlier
layer's states, and ``last+mean`` pooling gives both poolings at once), `slice_features`
cuts each candidate's features out of it, exactly what a forward for that candidate alone
gives, and `choose` keeps the most accurate, or the cheapest within a margin of it.

    found = candidates(config.get_text_config().num_hidden_layers)
    layers, pooling = union(found)
    features = ...  # EmbedText(layers=layers, pooling=pooling), [N, 2 * H * len(layers)]
    for c in found:
        x = slice_features(features, layers, c)  # [N, H * len(c.layers)]
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

__all__ = ["Candidate", "candidates", "union", "slice_features", "choose", "time_candidates", "PREFER_MARGINS"]

# --prefer: how far below the best fold accuracy a cheaper candidate may be and still be chosen
PREFER_MARGINS = {"accuracy": 0.0, "balanced": 0.005, "cost": 0.02}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A feature set a head may read: hidden-state `layers` pooled by `pooling`."""

    layers: tuple[int, ...]
    pooling: str

    @property
    def name(self) -> str:
        return f"layers {','.join(map(str, self.layers))} {self.pooling}"


def candidates(num_layers: int) -> list[Candidate]:
    """The feature sets compared for a model of `num_layers` decoder layers: layer 1 (the
    cheap early exit), a middle layer and a middle pair (a fifth and two fifths down: 6 and
    12 of 30), mean-pooled; the final state at the last position (the whole model; what a
    head read before the search)."""
    first = max(1, round(num_layers * 0.2))
    second = min(max(first + 1, round(num_layers * 0.4)), max(first, num_layers - 1))
    found = [Candidate((1,), "mean"), Candidate((first,), "mean"),
             Candidate(tuple(sorted({first, second})), "mean"), Candidate((-1,), "last")]
    # (a shallow model's middle layers may coincide; layer L is the final state, -1)
    return [c for c in dict.fromkeys(found) if num_layers not in c.layers]


def union(found: Sequence[Candidate]) -> tuple[tuple[int, ...], str]:
    """The layers and pooling of the one forward that yields every candidate's features."""
    return tuple(sorted({i for c in found for i in c.layers}, key=lambda i: (i < 0, i))), "last+mean"


def slice_features(features: np.ndarray, layers: Sequence[int], candidate: Candidate) -> np.ndarray:
    """A candidate's features ``[N, H * len(candidate.layers)]`` out of `union`'s ``[N, 2 *
    H * len(layers)]`` (each layer's last-position part, then each layer's mean part)."""
    layers = list(layers)
    width = features.shape[1] // (2 * len(layers))
    base = 0 if candidate.pooling == "last" else len(layers)
    parts = [features[:, (base + layers.index(i)) * width:(base + layers.index(i) + 1) * width]
             for i in candidate.layers]
    return np.concatenate(parts, axis=1)


def choose(accuracies: dict, costs: dict, prefer: str = "balanced"):
    """The cheapest candidate whose fold accuracy is within `PREFER_MARGINS[prefer]` of the
    best (ties in cost: the more accurate; then the first given). The keys are candidates,
    or any key a search ranks (e.g. a candidate with or without label rows)."""
    best = max(accuracies.values())
    near = [c for c, a in accuracies.items() if a >= best - PREFER_MARGINS[prefer] - 1e-12]
    return min(near, key=lambda c: (costs.get(c, float("inf")), -accuracies[c]))


def time_candidates(embed: Callable[[Candidate], object], found: Sequence[Candidate], *, rounds: int = 3) -> dict:
    """Milliseconds per call of `embed(candidate)` (one batch of rows each), the best of
    `rounds` interleaved rounds after one warm-up each: every candidate is timed under the
    same conditions, and another process waking up slows a round, never speeds one, so the
    best round is the one least disturbed (as the benchmarks time)."""
    for c in found:
        embed(c)
    times: dict[Candidate, list[float]] = {c: [] for c in found}
    for _ in range(rounds):
        for c in found:
            start = time.perf_counter()
            embed(c)
            times[c].append((time.perf_counter() - start) * 1000)
    return {c: float(min(t)) for c, t in times.items()}
