"""Pruned label search: exact label scores without running the whole label trie.

Exhaustive sequence scoring runs every internal node of the label trie for every row
(Banking77: 382 tokens per row, against ~20 suffix tokens). Here a row's trie is expanded
best-first instead, in rounds batched across all rows of the forward batch:

1. the suffixes run (one packed pass); each row's last hidden state gives the
   log-probabilities of the labels' first tokens;
2. a trie node's *path* log-probability bounds the total probability of every label
   below it (continuations are disjoint events), so each round picks, per row, the
   unexpanded nodes with the largest bounds and runs them all in one packed pass, each
   node attending to the prefix, its row's suffix and its own ancestors (which earlier
   rounds computed: `engine.CallState`); their children's log-probabilities follow;
3. a row stops when the mass still unexplored (the sum of its frontier's bounds) is below
   `tolerance` times the probability of the labels already resolved.

Calibration enters the bounds: with offsets ``c`` (log space), a label's weight is
``p_k / exp(c_k)``, so a node's bound is divided by ``exp(min c)`` over its labels.

Exactness: every label whose path was fully expanded gets its exact log-probability.
A label never expanded gets its probability *from the bound*: the path probability of its
first unexpanded node, shared evenly among the labels below that node. Together those
labels hold less than `tolerance` of the resolved mass, so every label's probability is
within `tolerance` of exhaustive scoring and the predicted label is the same (except
exact ties).

Each round picks the fewest top-bound nodes that could end the search: after the round,
the frontier left behind must be below `tolerance` of the resolved mass plus, at best,
the mass of the nodes picked. When that is most of a row's frontier (`BULK_SHARE`), the
model is not putting its mass on few labels and pruning will not pay: the row's whole
remaining trie then runs in that one round (tree attention among the round's nodes, as
in exhaustive scoring), instead of one round per trie level.

Nothing outlives the call: the suffixes' and nodes' keys and values live in the call's
`CallState` (or in the working cache, cropped on exit), and nothing is shared between
threads. This module holds the search's state (`Search`) and its rounds' steps
(`node_step`); `label_scorers.PrunedTrieScorer` runs them through `engine.forward`.
"""

from __future__ import annotations

import math

import torch

from beam_prefix.model.forward import CallState, Step
from beam_prefix.tasks.labels import LabelTrie
from beam_prefix.model.output_head import OutputHead

__all__ = ["Search", "node_step", "DEFAULT_TOLERANCE"]

DEFAULT_TOLERANCE = 1e-5
# a round that would pick at least this share of a row's frontier (of at least
# BULK_MIN_FRONTIER nodes) expands the row's whole remaining trie at once
BULK_SHARE = 0.75
BULK_MIN_FRONTIER = 16


def node_step(trie: LabelTrie, nodes: torch.Tensor, real: torch.Tensor, suffix: Step, call: CallState,
               column: torch.Tensor, ends: torch.Tensor) -> Step:
    """A round's nodes ``[B, Q]`` as a step: each sees its row's suffix and ancestors,
    those expanded earlier (in the call's columns) and those in this round."""
    batch, q = nodes.shape
    n = call.length
    device = nodes.device
    see_past = torch.zeros(batch, q, n + 1, dtype=torch.bool, device=device)
    width = suffix.ids.shape[1]
    see_past[:, :, :width] = suffix.real[:, None, :]
    eye = torch.eye(trie.size, dtype=torch.bool, device=device)
    above = trie.ancestors[nodes] & ~eye[nodes]  # [B, Q, T] strict ancestors, all expanded
    earlier = above & (column[:, None, :] >= 0)
    where = torch.where(earlier, column[:, None, :], torch.full_like(column[:, None, :], n))
    see_past.scatter_(2, where, True)
    see_past = see_past[:, :, :n] & real[:, :, None]
    # within the round: a node and its ancestors picked with it (a bulk round)
    see_new = trie.ancestors[nodes[:, :, None], nodes[:, None, :]] & real[:, :, None] & real[:, None, :]
    return Step(ids=trie.tokens[nodes], positions=ends[:, None] + trie.depth[nodes], real=real,
                see_new=see_new, see_past=see_past)


class Search:
    """Per-row search state over one trie (all tensors ``[B, ...]``, local to one call)."""

    def __init__(self, trie: LabelTrie, batch: int, tolerance: float, calibration: torch.Tensor | None):
        if not tolerance > 0:
            raise ValueError(f"label tolerance must be > 0, got {tolerance}")
        self.trie = trie
        device = self.device = trie.tokens.device
        n_edges = trie.edge_token.shape[0]
        self.path = torch.full((batch, n_edges), float("-inf"), device=device)  # log P(edge's target | prompt)
        self.known = torch.zeros(batch, n_edges, dtype=torch.bool, device=device)
        self.expanded = torch.zeros(batch, trie.size, dtype=torch.bool, device=device)
        self.log_tolerance = math.log(tolerance)
        k = trie.label_final.shape[0]
        self.offsets = calibration.float() if calibration is not None else torch.zeros(k, device=device)
        inf = torch.full_like(trie.node_labels, float("inf"), dtype=torch.float32)
        # smallest offset below each node: the largest weight any of its labels can get
        self.node_offsets = torch.where(trie.node_labels, self.offsets[None], inf).amin(-1)
        self.node_counts = trie.node_labels.sum(-1).clamp_min(1)

    def _set(self, rows: torch.Tensor, edges: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> None:
        rows = rows[:, None].expand_as(edges)[mask]
        self.path[rows, edges[mask]] = values[mask]
        self.known[rows, edges[mask]] = True

    def expand_root(self, head: OutputHead, last: torch.Tensor) -> None:
        """Log-probabilities of the first label tokens from each row's last hidden state ``[B, H]``."""
        edges, mask = self.trie.children[0], self.trie.children_mask[0]
        logp = head.logits_for(last, self.trie.edge_token[edges]) - head.logsumexp(last)[:, None]
        batch = last.shape[0]
        rows = torch.arange(batch, device=self.device)
        self._set(rows, edges[None].expand(batch, -1), mask[None].expand(batch, -1), logp)

    def expand(self, head: OutputHead, hidden: torch.Tensor, rows: torch.Tensor, nodes: torch.Tensor) -> None:
        """Children of `nodes` (one per entry of `rows`) from their hidden states ``[R, H]``,
        shallowest first: a node's path log-probability comes from its parent's expansion."""
        depth = self.trie.depth[nodes]
        for level in depth.unique().tolist():
            at = depth == level
            self._expand(head, hidden[at], rows[at], nodes[at])

    def _expand(self, head: OutputHead, hidden: torch.Tensor, rows: torch.Tensor, nodes: torch.Tensor) -> None:
        edges, mask = self.trie.children[1 + nodes], self.trie.children_mask[1 + nodes]  # [R, C]
        r, c = edges.shape
        logits = head.pair_logits(hidden[:, None].expand(r, c, -1).reshape(r * c, -1),
                                  self.trie.edge_token[edges].reshape(-1)).view(r, c)
        base = self.path[rows, self.trie.node_edge[nodes]]
        self._set(rows, edges, mask, base[:, None] + logits - head.logsumexp(hidden)[:, None])
        self.expanded[rows, nodes] = True

    def _resolved_mass(self) -> torch.Tensor:
        """log of the calibrated weight of the labels already resolved, ``[B]``."""
        final = self.trie.label_final
        weights = torch.where(self.known[:, final], self.path[:, final] - self.offsets[None], float("-inf"))
        return torch.logsumexp(weights, dim=-1)

    def choose(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The nodes to run in the next round, ``[B, Q]`` with ``[B, Q]`` real flags."""
        node_edge = self.trie.node_edge
        frontier = self.known[:, node_edge] & ~self.expanded
        bounds = torch.where(frontier, self.path[:, node_edge] - self.node_offsets[None], float("-inf"))
        resolved = self._resolved_mass()
        ordered, order = bounds.sort(dim=-1, descending=True)
        picked = torch.logcumsumexp(ordered, dim=-1)  # mass of the top j+1
        left = torch.logcumsumexp(ordered.flip(-1), dim=-1).flip(-1)  # mass from j on
        left = torch.cat([left[:, 1:], torch.full_like(left[:, :1], float("-inf"))], dim=-1)  # after top j+1
        enough = left < self.log_tolerance + torch.logaddexp(resolved[:, None], picked)
        count = frontier.sum(-1)
        take = torch.where(enough.any(-1), enough.float().argmax(-1) + 1, count)
        take = torch.minimum(take, count)
        done = torch.logsumexp(bounds, -1) < self.log_tolerance + resolved  # also: empty frontier
        take = torch.where(done | (count == 0), torch.zeros_like(take), take)
        bulk = (take > 0) & (count >= BULK_MIN_FRONTIER) & (take >= BULK_SHARE * count)
        if bool(bulk.any()):  # every unexpanded node of those rows, ahead of the others
            rest = ~self.expanded & bulk[:, None]
            take = torch.where(bulk, rest.sum(-1), take)
            order = torch.where(bulk[:, None], (~rest).long().argsort(dim=-1, stable=True), order)
        width = max(int(take.max()), 1)
        real = torch.arange(width, device=self.device)[None] < take[:, None]
        nodes = torch.where(real, order[:, :width], torch.zeros_like(order[:, :width]))
        return nodes, real

    def raw_scores(self) -> torch.Tensor:
        """``[B, K]``: exact log-probabilities of resolved labels; for the others their first
        unexpanded node's path log-probability shared evenly among the labels below it."""
        trie = self.trie
        final = trie.label_final
        batch = self.path.shape[0]
        exact = self.path[:, final]
        device = self.device
        expanded = torch.cat([self.expanded, torch.ones(batch, 1, dtype=torch.bool, device=device)], dim=-1)
        on_path = expanded[:, trie.label_nodes]  # [B, K, L]
        first = (~on_path).float().argmax(-1)  # first unexpanded node on the path
        node = trie.label_nodes[torch.arange(final.shape[0], device=device)[None], first]  # [B, K]
        node_path = torch.cat([self.path[:, trie.node_edge], torch.zeros(batch, 1, device=device)], dim=-1)
        counts = torch.cat([self.node_counts, torch.ones(1, dtype=torch.long, device=device)])
        shared = torch.gather(node_path, 1, node) - counts[node].float().log()
        return torch.where(self.known[:, final], exact, shared)
