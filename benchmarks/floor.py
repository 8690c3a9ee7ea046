"""The FLOP floor: the least time the per-row work can take on this machine.

Work per row is 2 x (non-embedding parameters) x (tokens computed for the row: its suffix,
plus the label trie in sequence mode). The machine's rate is measured here, for the
model's own linear-layer shapes with as many token rows as one batch holds, so the floor
is what dense matmuls of exactly that shape reach on these cores.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

__all__ = ["non_embedding_params", "matmul_gflops", "floor_ms_per_row", "other_flops_per_row"]


def non_embedding_params(model) -> int:
    """Parameters outside the input embedding and the output head (counted once if tied)."""
    skip = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def matmul_gflops(model, token_rows: int, *, repeats: int = 5, dtype=torch.float32) -> float:
    """Dense matmul throughput (GFLOP/s) over the model's linear-layer shapes (one pass over
    every decoder linear layer's shape, weighted by how many layers have it)."""
    head = model.get_output_embeddings()
    shapes = Counter(tuple(m.weight.shape) for m in model.modules()
                     if isinstance(m, torch.nn.Linear) and m is not head)
    if not shapes:  # e.g. GPT-2's Conv1D projections
        shapes = Counter(tuple(p.shape) for n, p in model.named_parameters()
                         if p.dim() == 2 and p is not model.get_input_embeddings().weight
                         and (head is None or p is not head.weight))
    flops, seconds = 0.0, 0.0
    with torch.inference_mode():
        for (out_f, in_f), count in shapes.items():
            x = torch.randn(token_rows, in_f, dtype=dtype)
            w = torch.randn(out_f, in_f, dtype=dtype)
            torch.nn.functional.linear(x, w)  # warm-up
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                torch.nn.functional.linear(x, w)
                best = min(best, time.perf_counter() - start)
            flops += 2.0 * token_rows * in_f * out_f * count
            seconds += best * count
    return flops / seconds / 1e9


def floor_ms_per_row(params: int, tokens_per_row: float, gflops: float) -> float:
    """Milliseconds per row at `gflops` for 2 x params x tokens FLOPs."""
    return 2.0 * params * tokens_per_row / (gflops * 1e9) * 1e3


def other_flops_per_row(config, *, prefix_tokens: int, suffix_tokens: float, label_tokens: int,
                        labels: int) -> float:
    """FLOPs per row that 2 x params x tokens leaves out, for the floor that counts them:
    attention scores and weighted values (4 x heads x head_dim per query-key pair: suffix
    tokens see the prefix and the earlier suffix tokens, trie tokens the prefix and the
    whole suffix, their few ancestors left out; sliding windows ignored), and the output
    head: the label rows at one position in first-token mode, the whole vocabulary at each
    trie parent in sequence mode (the log-sum-exp that makes label log-probabilities exact)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    pairs = suffix_tokens * (prefix_tokens + suffix_tokens / 2) + label_tokens * (prefix_tokens + suffix_tokens)
    attention = 4.0 * heads * head_dim * config.num_hidden_layers * pairs
    outputs = labels if not label_tokens else config.vocab_size * (1 + label_tokens)
    return attention + 2.0 * config.hidden_size * outputs
