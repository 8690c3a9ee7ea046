"""Label scoring: batched over a shared prefix cache, and the full re-encoding reference.

A label's raw score is the log-likelihood of its continuation after the prompt:

* `first_token` mode (labels with distinct first tokens): the output-head logit of the
  label's first token at the row's last real position (softmax over the labels equals
  the renormalised first-token probability);
* `sequence` mode: the summed log-probability of all of the label's tokens and its
  terminator, computed exactly in the same forward pass as the suffix: the labels'
  tokens form a trie appended to every row, each trie token attending to the prefix,
  the row's suffix and its own ancestors (tree attention through a 4-D mask).

The prefix is attended to either directly at batch 1 (`beam_prefix.attention`, the
default for sdpa models; the batch then runs packed, so pad columns cost nothing) or
through a working `DynamicCache` seated on it (any attention implementation;
`first_token` mode then uses a plain 2-D mask).

Only what the answer needs is computed: hidden states at the needed positions, the
label rows of the output head in `first_token` mode, and a log-sum-exp over the
vocabulary only at trie parents in `sequence` mode; never full-vocabulary logits for
every position.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from beam_prefix.engine import Step, forward
from beam_prefix.prefix_cache import PrefixCache, WorkingCache

__all__ = ["LabelTrie", "OutputHead", "choose_mode", "score_cached", "score_full"]


def choose_mode(requested: str, label_ids: Sequence[Sequence[int]]) -> str:
    """`auto` picks `first_token` when every label has its own first token."""
    if requested != "auto":
        return requested
    firsts = [ids[0] for ids in label_ids]
    return "first_token" if len(set(firsts)) == len(firsts) else "sequence"


class OutputHead:
    """The LM head restricted to what scoring needs (weights shared with the model)."""

    def __init__(self, model):
        head = model.get_output_embeddings()
        self.weight: torch.Tensor = head.weight  # [vocab, hidden]
        self.bias: torch.Tensor | None = getattr(head, "bias", None)
        config = model.config
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.scale = getattr(config, "logit_scale", None)

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def logits_for(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of `token_ids` only. hidden: ``[N, H]``; token_ids: ``[K]`` -> ``[N, K]``."""
        logits = hidden @ self.weight[token_ids].T
        if self.bias is not None:
            logits = logits + self.bias[token_ids]
        return self._finish(logits.float())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary. hidden: ``[N, H]`` -> ``[N, V]`` (fp32)."""
        logits = hidden @ self.weight.T
        if self.bias is not None:
            logits = logits + self.bias
        return self._finish(logits.float())

    def pair_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logit of one token per row. hidden: ``[N, H]``; token_ids: ``[N]`` -> ``[N]``."""
        logits = (hidden * self.weight[token_ids]).sum(-1)
        if self.bias is not None:
            logits = logits + self.bias[token_ids]
        return self._finish(logits.float())

    def logsumexp(self, hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """log-sum-exp over the vocabulary, in chunks of rows. hidden: ``[N, H]`` -> ``[N]``."""
        out = []
        for start in range(0, hidden.shape[0], chunk):
            logits = hidden[start:start + chunk] @ self.weight.T
            if self.bias is not None:
                logits = logits + self.bias
            out.append(torch.logsumexp(self._finish(logits.float()), dim=-1))
        return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


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
    def build(cls, label_ids: Sequence[Sequence[int]]) -> "LabelTrie":
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
        ancestors = torch.zeros(t, t, dtype=torch.bool)
        for i, (_, _, parent) in enumerate(nodes):
            ancestors[i, i] = True
            if parent >= 0:
                ancestors[i] |= ancestors[parent]
        longest = max(len(p) for p in paths)
        label_edges = torch.zeros(len(paths), longest, dtype=torch.long)
        label_mask = torch.zeros(len(paths), longest, dtype=torch.bool)
        label_nodes = torch.full((len(paths), longest), t, dtype=torch.long)
        node_labels = torch.zeros(t, len(paths), dtype=torch.bool)
        for k, (ids, path) in enumerate(zip(label_ids, paths)):
            label_edges[k, :len(path)] = torch.tensor(path)
            label_mask[k, :len(path)] = True
            for j in range(len(ids) - 1):
                label_nodes[k, j] = node_of[tuple(ids[:j + 1])]
                node_labels[label_nodes[k, j], k] = True
        node_edge = torch.tensor([edges[key] for key in node_of], dtype=torch.long)  # dicts keep order
        kids: list[list[int]] = [[] for _ in range(1 + t)]
        for e, parent in enumerate(edge_parent):
            kids[parent].append(e)
        width = max(len(k) for k in kids)
        children = torch.zeros(1 + t, width, dtype=torch.long)
        children_mask = torch.zeros(1 + t, width, dtype=torch.bool)
        for p, k in enumerate(kids):
            children[p, :len(k)] = torch.tensor(k, dtype=torch.long)
            children_mask[p, :len(k)] = True
        return cls(
            tokens=torch.tensor([n[0] for n in nodes], dtype=torch.long),
            depth=torch.tensor([n[1] for n in nodes], dtype=torch.long),
            ancestors=ancestors,
            edge_parent=torch.tensor(edge_parent, dtype=torch.long),
            edge_token=torch.tensor(edge_token, dtype=torch.long),
            label_edges=label_edges,
            label_mask=label_mask,
            node_edge=node_edge,
            children=children,
            children_mask=children_mask,
            label_final=torch.tensor([p[-1] for p in paths], dtype=torch.long),
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


def score_cached(model, head: OutputHead, prefix: PrefixCache, suffixes: Sequence[Sequence[int]],
                 mode: str, first_ids: torch.Tensor, trie: LabelTrie | None,
                 working: WorkingCache | None = None) -> torch.Tensor:
    """Raw label scores for a batch of suffixes over the cached prefix: ``[B, K]``, with
    the whole label trie (exhaustive) in sequence mode: one forward pass of
    ``[suffix | trie internal nodes]`` per row (`engine.forward`).

    With `working` None the model must use `attention.SHARED_SDPA`: the suffixes run with
    no cache and attend to the batch-1 prefix directly (nothing is stored). Otherwise they
    run through `working`, seated on the batch-expanded prefix, which is back at the
    prefix length when this returns or raises.
    """
    step = Step.suffixes(suffixes, prefix.length)
    lengths = step.lengths
    batch, width = step.ids.shape
    t = trie.size if mode == "sequence" else 0
    if t:
        step = _with_trie(step, trie)
    with torch.inference_mode():
        if working is None:
            hidden = forward(model, prefix, step)
        else:
            with working.use(batch) as cache:
                hidden = forward(model, prefix, step, cache=cache)
        last = hidden[torch.arange(batch), lengths - 1]  # [B, H]: each row's last real token
        if not t:
            return head.logits_for(last, first_ids)
        parents = torch.cat([last[:, None], hidden[:, width:width + t]], dim=1)  # [B, 1+T, H]
        lse = head.logsumexp(parents.reshape(batch * (1 + t), -1)).view(batch, 1 + t)
        edge_hidden = parents[:, trie.edge_parent]  # [B, E, H]
        n_edges = trie.edge_token.shape[0]
        edge_logits = head.pair_logits(edge_hidden.reshape(batch * n_edges, -1),
                                       trie.edge_token.repeat(batch)).view(batch, n_edges)
        edge_logprobs = edge_logits - lse[:, trie.edge_parent]
        return trie.label_scores(edge_logprobs)


def _with_trie(step: Step, trie: LabelTrie) -> Step:
    """``[suffix | pad | trie internal nodes]`` per row: each node sees the row's real
    suffix and its own ancestors (tree attention), at position suffix end + depth."""
    batch, width = step.ids.shape
    t = trie.size
    lengths = step.lengths
    q = width + t
    see = torch.zeros(batch, q, q, dtype=torch.bool)
    see[:, :width, :width] = step.see_new
    see[:, width:, :width] = step.real[:, None, :]
    see[:, width:, width:] = trie.ancestors[None]
    start = step.positions[:, :1]
    return Step(ids=torch.cat([step.ids, trie.tokens[None].expand(batch, -1)], dim=1),
                positions=torch.cat([step.positions, start + lengths[:, None] + trie.depth[None]], dim=1),
                real=torch.cat([step.real, torch.ones(batch, t, dtype=torch.bool)], dim=1), see_new=see)


def score_full(model, prompt_ids: Sequence[int], mode: str, first_ids: torch.Tensor,
               label_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Reference raw scores for one prompt, re-encoded whole with no prefix cache: ``[K]``.

    `first_token`: the full model forward's last-position logits. `sequence`: one pass over
    the prompt, then each label's tokens one label at a time on that prompt's own cache.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    with torch.inference_mode():
        if mode == "first_token":
            logits = model(input_ids=ids).logits[0, -1].float()
            return logits[first_ids]
        cache = DynamicCache(config=model.config)
        for layer in cache.layers:
            if getattr(layer, "is_sliding", False):
                layer.activate_past_recording()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        n = ids.shape[1]
        scores = []
        for label in label_ids:
            total = first[label[0]]
            if len(label) > 1:
                cont = torch.tensor([list(label[:-1])], dtype=torch.long, device=device)
                step = model(input_ids=cont, cache=cache, use_cache=True,
                             position_ids=torch.arange(n, n + cont.shape[1], device=device)[None])
                cache.crop(-cont.shape[1])
                logp = torch.log_softmax(step.logits[0].float(), dim=-1)
                total = total + logp[torch.arange(len(label) - 1), torch.tensor(label[1:])].sum()
            scores.append(total)
        return torch.stack(scores)
