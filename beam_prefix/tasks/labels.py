"""The labels as tokens: each label's token ids after the prompt, and their trie.

`label_token_ids` asks the prompt how a label is written as an answer (`PromptLayout`'s
answer format) and checks that it tokenizes the same after every probe text: a label
that merges with the end of the prompt would be scored on tokens a full re-encoding would
not produce. `LabelTrie` holds the labels' token sequences as a trie, the shape sequence
scoring runs (`beam_prefix.engines.label_scorers`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from beam_prefix.errors import BoundaryError
from beam_prefix.tasks.prompt import PROBE_TEXTS, PromptLayout

__all__ = ["label_token_ids", "LabelTrie"]

_CPU = torch.device("cpu")


def label_token_ids(layout: PromptLayout, names: Sequence[str],
                    probes: Sequence[str] = PROBE_TEXTS[:3]) -> tuple[tuple[int, ...], ...]:
    """Each label's tokens (and its terminator) as the tokenizer writes them after the
    prompt; the same after every probe text.

    Raises:
        BoundaryError: a label's continuation merges with the end of the prompt.
    """
    label_ids = []
    for name in names:
        cont = layout.label_lead + name + layout.terminator
        found = set()
        for probe in probes:
            base = layout.natural_ids(probe)
            ids = layout.continuation_ids(probe, cont)
            found.add(ids[len(base):] if ids[:len(base)] == base else None)
        if len(found) != 1 or None in found or not next(iter(found)):
            raise BoundaryError(
                f"label {name!r} does not tokenize cleanly after the prompt: the prompt ends "
                f"with {layout.ending[-20:]!r} and the label continuation "
                f"{cont!r} merges with it; rename the label or end the prompt with a separator")
        label_ids.append(next(iter(found)))
    return tuple(label_ids)


@dataclasses.dataclass(frozen=True)
class LabelTrie:
    """The labels' token sequences as a trie.

    Only internal nodes (tokens that something follows) are fed to the model; every
    label token is an *edge* scored from its parent's hidden state.

    Attributes:
        tokens: ``[T]`` token ids of the internal nodes.
        depth: ``[T]`` depth of each internal node (0 = first label token).
        ancestors: ``[T, T]`` bool, ``ancestors[q, k]``: node k is q itself or above it.
        edge_parent: ``[E]`` parent of each edge: 0 = the row's last suffix token, 1 + m =
            internal node m.
        edge_token: ``[E]`` the token each edge predicts.
        label_edges: ``[K, L]`` edge indices of each label's path, padded with 0.
        label_mask: ``[K, L]`` which entries of `label_edges` are real.
        node_edge: ``[T]`` the edge leading into each internal node.
        children: ``[1 + T, C]`` edges leaving the root (row 0) and each internal node
            (row 1 + m), padded with 0; `children_mask` says which are real.
        label_final: ``[K]`` the last edge of each label's path.
        label_nodes: ``[K, L]`` internal nodes on each label's path, root side first,
            padded with T (a column that callers treat as always expanded).
        node_labels: ``[T, K]`` bool, label k passes through node m.
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    edge_parent: torch.Tensor
    edge_token: torch.Tensor
    label_edges: torch.Tensor
    label_mask: torch.Tensor
    node_edge: torch.Tensor
    children: torch.Tensor
    children_mask: torch.Tensor
    label_final: torch.Tensor
    label_nodes: torch.Tensor
    node_labels: torch.Tensor

    @classmethod
    def build(cls, label_ids: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> "LabelTrie":
        """The trie of `label_ids`, its tensors on `device` (built on the CPU, then moved)."""
        trie = cls._build(label_ids)
        return cls(**{f.name: getattr(trie, f.name).to(device) for f in dataclasses.fields(cls)})

    @classmethod
    def _build(cls, label_ids: Sequence[Sequence[int]]) -> "LabelTrie":
        node_of: dict[tuple[int, ...], int] = {}  # path prefix -> internal node index
        nodes: list[tuple[int, int, int]] = []  # (token, depth, parent node or -1)
        edges: dict[tuple[int, ...], int] = {}
        edge_parent, edge_token, paths = [], [], []
        for ids in label_ids:
            path = []
            for j, tok in enumerate(ids):
                key = tuple(ids[:j + 1])
                if key not in edges:
                    parent_key = tuple(ids[:j])
                    edges[key] = len(edge_parent)
                    edge_parent.append(0 if j == 0 else 1 + node_of[parent_key])
                    edge_token.append(tok)
                path.append(edges[key])
                if j < len(ids) - 1 and key not in node_of:  # something follows: internal node
                    node_of[key] = len(nodes)
                    nodes.append((tok, j, node_of.get(tuple(ids[:j]), -1) if j else -1))
            paths.append(path)
        t = len(nodes)
        ancestors = torch.zeros(t, t, dtype=torch.bool, device=_CPU)
        for i, (_, _, parent) in enumerate(nodes):
            ancestors[i, i] = True
            if parent >= 0:
                ancestors[i] |= ancestors[parent]
        longest = max(len(p) for p in paths)
        label_edges = torch.zeros(len(paths), longest, dtype=torch.long, device=_CPU)
        label_mask = torch.zeros(len(paths), longest, dtype=torch.bool, device=_CPU)
        label_nodes = torch.full((len(paths), longest), t, dtype=torch.long, device=_CPU)
        node_labels = torch.zeros(t, len(paths), dtype=torch.bool, device=_CPU)
        for k, (ids, path) in enumerate(zip(label_ids, paths)):
            label_edges[k, :len(path)] = torch.tensor(path, dtype=torch.long, device=_CPU)
            label_mask[k, :len(path)] = True
            for j in range(len(ids) - 1):
                label_nodes[k, j] = node_of[tuple(ids[:j + 1])]
                node_labels[label_nodes[k, j], k] = True
        node_edge = torch.tensor([edges[key] for key in node_of], dtype=torch.long, device=_CPU)  # dicts keep order
        kids: list[list[int]] = [[] for _ in range(1 + t)]
        for e, parent in enumerate(edge_parent):
            kids[parent].append(e)
        width = max(len(k) for k in kids)
        children = torch.zeros(1 + t, width, dtype=torch.long, device=_CPU)
        children_mask = torch.zeros(1 + t, width, dtype=torch.bool, device=_CPU)
        for p, k in enumerate(kids):
            children[p, :len(k)] = torch.tensor(k, dtype=torch.long, device=_CPU)
            children_mask[p, :len(k)] = True
        return cls(
            tokens=torch.tensor([n[0] for n in nodes], dtype=torch.long, device=_CPU),
            depth=torch.tensor([n[1] for n in nodes], dtype=torch.long, device=_CPU),
            ancestors=ancestors,
            edge_parent=torch.tensor(edge_parent, dtype=torch.long, device=_CPU),
            edge_token=torch.tensor(edge_token, dtype=torch.long, device=_CPU),
            label_edges=label_edges,
            label_mask=label_mask,
            node_edge=node_edge,
            children=children,
            children_mask=children_mask,
            label_final=torch.tensor([p[-1] for p in paths], dtype=torch.long, device=_CPU),
            label_nodes=label_nodes,
            node_labels=node_labels,
        )

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def label_scores(self, edge_logprobs: torch.Tensor) -> torch.Tensor:
        """Sum edge log-probs along each label's path. ``[B, E]`` -> ``[B, K]``."""
        gathered = edge_logprobs[:, self.label_edges]  # [B, K, L]
        return (gathered * self.label_mask).sum(-1)
