"""Batch 1 (streaming, small bundles): C at batch 1 against B, timed in interleaved rounds
on the same rows, with the FLOP floor of a one-row forward pass.

At batch 1 both C and B run one row's suffix through every layer; what C can win over B
is only the fixed cost around the matmuls (attention dispatch, packing, masks, the cache
copy B's `DynamicCache` makes per row). The floor is the dense-matmul time of one row's
tokens (`benchmarks.floor`, measured for this model's linear shapes at that many token
rows), so the report shows how much of C and B is above it.
"""

from __future__ import annotations

import logging

from benchmarks import contenders
from benchmarks.floor import floor_ms_per_row, matmul_gflops, non_embedding_params

__all__ = ["batch_one"]

_LOGGER = logging.getLogger(__name__)


def batch_one(name: str, clf, texts: list[str], rounds: int) -> dict:
    """B and C (batch 1) in `rounds` interleaved rounds over `texts`; best round of each."""
    contenders.cached_recipe(clf, texts[:2])
    contenders.batched(clf, texts[:2], 1)
    runs = {"B": [], "C": []}
    for r in range(rounds):
        b_labels, ms = contenders.timed(lambda: contenders.cached_recipe(clf, texts), len(texts))
        runs["B"].append(ms)
        c_labels, ms = contenders.timed(lambda: contenders.batched(clf, texts, 1), len(texts))
        runs["C"].append(ms)
        _LOGGER.info("%s batch-1 round %d: B %.1f, C %.1f ms/row", name, r + 1, runs["B"][-1], runs["C"][-1])
    tokens = sum(len(clf.encode(t).suffix_ids) for t in texts) / len(texts) + clf.label_tokens
    gflops = matmul_gflops(clf.model, max(1, int(round(tokens))))
    b_ms, c_ms = min(runs["B"]), min(runs["C"])
    return {"rows": len(texts), "rounds": runs, "b_ms_per_row": b_ms, "c_ms_per_row": c_ms,
            "c_over_b": b_ms / c_ms, "agreement": sum(a == b for a, b in zip(b_labels, c_labels)) / len(texts),
            "tokens_per_row": tokens, "matmul_gflops": gflops,
            "floor_ms_per_row": floor_ms_per_row(non_embedding_params(clf.model), tokens, gflops)}
