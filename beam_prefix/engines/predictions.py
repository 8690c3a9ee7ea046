"""What `PrefixClassifier` answers per row: a `Prediction` (a label and its scores) or an
`Embedding` (the features a head reads). Plain frozen records, no tensors."""

from __future__ import annotations

import dataclasses

__all__ = ["Prediction", "Embedding"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The classification of one text.

    Attributes:
        label: the most probable label.
        score: its probability.
        scores: probability of every label (sums to 1), in task label order.
        logprobs: the same as natural logs, computed in log space (no underflow). With
            pruned label search, a label never expanded has its bound here (see
            `beam_prefix.engines.label_search`), not its exact log-probability; its probability
            is still within the tolerance of exhaustive scoring.
        suffix_tokens: tokens computed for this row (its suffix, plus its label tokens);
            the prefix tokens were reused from the cache.
        text_tokens: tokens of the row's text before any truncation.
        truncated: whether the text was cut to the token budget.
        label_tokens: label-trie tokens run for this row (sequence mode: the whole trie
            with exhaustive search, the nodes it expanded with pruned search; else 0).
        features: the row's features, when asked for (`classify_encoded(features=True)`).
    """

    label: str
    score: float
    scores: dict[str, float]
    suffix_tokens: int
    logprobs: dict[str, float] = dataclasses.field(default_factory=dict, repr=False)
    text_tokens: int = 0
    truncated: bool = False
    label_tokens: int = 0
    features: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)

    def top(self, k: int) -> list[tuple[str, float]]:
        """The `k` most probable labels with their probabilities, best first."""
        return sorted(self.scores.items(), key=lambda item: -item[1])[:k]


@dataclasses.dataclass(frozen=True)
class Embedding:
    """One text's features (`PrefixClassifier.embed`).

    Attributes:
        features: the hidden states the head reads (each layer pooled over the row's
            positions as asked: its last position or the mean of its own tokens), concatenated.
        text_tokens, truncated: as for `Prediction`.
        suffix_tokens: tokens computed for the row (its suffix).
    """

    features: tuple[float, ...] = dataclasses.field(repr=False)
    text_tokens: int = 0
    truncated: bool = False
    suffix_tokens: int = 0
