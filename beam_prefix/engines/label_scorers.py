"""Label scorers: the ways a row's label scores come out of the one cached forward.

A scorer turns a batch of rows (their suffix token ids) into raw label scores ``[B, K]``,
running `engine.forward` over the cached prefix, and says what the no-cache reference of
one whole prompt is (`full`). Each is a class behind one interface, chosen once per
classifier by `build_scorer` from the task (`SCORERS` is the registry):

* `FirstTokenScorer` (``first_token``; labels with distinct first tokens): the
  output-head logit of each label's first token at the row's last position;
* `TrieScorer` (``exhaustive``): each label's summed token log-probabilities, the whole
  label trie run in the same pass as the suffix (each trie token attends to the prefix,
  the row's suffix and its own ancestors: tree attention through a 4-D mask);
* `PrunedTrieScorer` (``pruned``): the same scores to `label_tolerance`, expanding the
  trie best-first (`beam_prefix.engines.label_search`);
* `HeadScorer` (``head``): no label tokens at all: a trained linear head
  (`beam_prefix.tasks.trained_head`) on the row's hidden state(s) at its last position.

Every scorer also hands back each row's *features*, the hidden state(s) at its last suffix
position that the suffix pass computed anyway (the final normalised state; a head's own
layers), so callers can output them at no extra cost.

Adding a scorer is one subclass with a `name` and one `register` line; `build_scorer`
picks it when the task's `scoring` names it.

Only what an answer needs is computed: hidden states at the needed positions, the label
rows of the head for first tokens, a log-sum-exp over the vocabulary only at trie
parents; never full-vocabulary logits for every position. Every tensor is made on the
model's device.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Sequence

import torch

from beam_prefix.model.forward import CallState, Step, forward, seated
from beam_prefix.engines.label_search import Search, node_step
from beam_prefix.engines.suffix_states import full_states, suffix_states
from beam_prefix.tasks.labels import LabelTrie
from beam_prefix.model.output_head import OutputHead
from beam_prefix.model.prefix_cache import PrefixCache, WorkingCache, new_cache

__all__ = ["LabelScorer", "Scored", "FirstTokenScorer", "TrieScorer", "PrunedTrieScorer", "HeadScorer", "SCORERS", "pool",
           "register", "scorer_name", "build_scorer"]


class Scored(NamedTuple):
    """A batch's scores: raw label scores ``[B, K]``, the label tokens each row ran, and each
    row's features ``[B, F]`` (see the module docstring)."""

    raw: torch.Tensor
    label_tokens: list[int]
    features: torch.Tensor


class LabelScorer:
    """Raw label scores for rows over a cached prefix, and their no-cache reference.

    Args:
        task: the classification task (its settings, e.g. `label_tolerance`).
        label_ids: each label's token ids (`labels.label_token_ids`).
        head: the model's output head; its device is where every tensor is made.
    """

    name: ClassVar[str]
    mode: ClassVar[str] = "first_token"  # what a label's score is: "first_token", "sequence" or "head"
    search: ClassVar[str] = "exhaustive"  # how much of the labels a row runs: "exhaustive" or "pruned"

    def __init__(self, task, label_ids: Sequence[Sequence[int]], head: OutputHead):
        self.task, self.label_ids, self.head = task, tuple(label_ids), head
        self.device = head.weight.device

    @property
    def label_tokens(self) -> int:
        """The most label tokens one row runs (0 when only the suffix runs)."""
        return 0

    def score(self, model, prefix: PrefixCache, suffixes: Sequence[Sequence[int]], *,
              working: WorkingCache | None, calibration: torch.Tensor | None) -> Scored:
        """Raw scores ``[B, K]`` (log-likelihoods up to a per-row constant), the label tokens
        run per row, and the rows' features. `working`: the expanded engine's working cache
        (None: shared-prefix attention); `calibration`: ``[K]`` log-space offsets, for scorers
        that search by them."""
        raise NotImplementedError

    def features(self, model, prefix: PrefixCache, suffixes: Sequence[Sequence[int]], *,
                 working: WorkingCache | None, layers: Sequence[int] = (-1,), pooling: str = "last") -> torch.Tensor:
        """Each row's features from one suffix pass (no label tokens), `layers` concatenated:
        ``[B, H * len(layers)]``. `pooling`: ``last``, the hidden states at the row's last
        suffix position; ``mean``, their mean over the row's suffix positions (its text
        and the template's closing tokens: the row's own tokens, never the prefix)."""
        states, step = suffix_states(model, prefix, suffixes, working=working, layers=layers, device=self.device)
        with torch.inference_mode():
            return pool(states, step, pooling)

    def full(self, model, prompt_ids: Sequence[int], *, suffix_length: int | None = None) -> torch.Tensor:
        """The reference raw scores ``[K]`` of one whole prompt, re-encoded with no cache
        (`suffix_length`: how many of its last tokens are the row's suffix)."""
        raise NotImplementedError

    def full_features(self, model, prompt_ids: Sequence[int], layers: Sequence[int] = (-1,), *,
                      pooling: str = "last", suffix_length: int | None = None) -> torch.Tensor:
        """The reference of `features` for one whole prompt, re-encoded with no cache:
        ``[H * len(layers)]`` (``mean`` pooling needs `suffix_length`)."""
        states = full_states(model, prompt_ids, layers, self.device)
        with torch.inference_mode():
            last = [s[-1] for s in states] if pooling in ("last", "last+mean") else []
            mean = [s[-suffix_length:].mean(0) for s in states] if pooling in ("mean", "last+mean") else []
            return torch.cat(last + mean, dim=-1)

    def exhaustive(self) -> "LabelScorer":
        """The scorer that computes every label's own score (what a search is checked against)."""
        return self


def pool(states: Sequence[torch.Tensor], step: Step, pooling: str) -> torch.Tensor:
    """Each row's features ``[B, H * len(states)]`` from a suffix step's hidden states (one
    ``[B, Q, H]`` per layer read): ``last``, at the row's last suffix position; ``mean``, the
    mean over its suffix positions (pad columns weigh nothing). What `LabelScorer.features`
    returns, and what a tuning step trains (`benchmarks.tuning_survey`). ``last+mean``: both,
    ``[B, 2 * H * len(states)]``, the last-position parts first."""
    if pooling == "last+mean":
        return torch.cat([pool(states, step, "last"), pool(states, step, "mean")], dim=-1)
    if pooling == "mean":
        width = states[0].shape[1]
        real = (torch.arange(width, device=step.ids.device)[None] < step.lengths[:, None]).to(states[0].dtype)
        weights = real / step.lengths[:, None].to(states[0].dtype)  # [B, Q]
        return torch.cat([torch.einsum("bq,bqh->bh", weights, s) for s in states], dim=-1)
    rows = torch.arange(step.ids.shape[0], device=step.ids.device)
    return torch.cat([s[rows, step.lengths - 1] for s in states], dim=-1)


SCORERS: dict[str, type[LabelScorer]] = {}


def register(cls: type[LabelScorer]) -> type[LabelScorer]:
    """Add a scorer class to `SCORERS` under its `name`."""
    SCORERS[cls.name] = cls
    return cls


@register
class FirstTokenScorer(LabelScorer):
    """The logit of each label's first token (labels must start with distinct tokens)."""

    name = "first_token"

    def __init__(self, task, label_ids, head):
        super().__init__(task, label_ids, head)
        firsts = [ids[0] for ids in self.label_ids]
        if len(set(firsts)) < len(firsts):
            raise ValueError("scoring='first_token' but labels share first tokens; use 'sequence' or 'auto'")
        self.first_ids = torch.tensor(firsts, dtype=torch.long, device=self.device)

    def score(self, model, prefix, suffixes, *, working, calibration):
        last = self.features(model, prefix, suffixes, working=working)
        with torch.inference_mode():
            return Scored(self.head.logits_for(last, self.first_ids), [0] * len(suffixes), last)

    def full(self, model, prompt_ids, *, suffix_length=None):
        with torch.inference_mode():
            logits = model(input_ids=_ids(prompt_ids, self.device), use_cache=False).logits[0, -1].float()
            return logits[self.first_ids]


@register
class TrieScorer(LabelScorer):
    """Every label's whole token sequence, the label trie run with the suffix in one pass."""

    name = "exhaustive"
    mode = "sequence"

    def __init__(self, task, label_ids, head, *, trie: LabelTrie | None = None):
        super().__init__(task, label_ids, head)
        self.trie = trie if trie is not None else LabelTrie.build(self.label_ids, self.device)

    @property
    def label_tokens(self) -> int:
        return self.trie.size

    def score(self, model, prefix, suffixes, *, working, calibration):
        trie, head = self.trie, self.head
        step = Step.suffixes(suffixes, prefix.length, self.device)
        batch, width = step.ids.shape
        t = trie.size
        with torch.inference_mode():
            with seated(working, batch) as cache:
                hidden = forward(model, prefix, step.with_tree(trie.tokens, trie.depth, trie.ancestors), cache=cache)
            last = hidden[torch.arange(batch, device=self.device), step.lengths - 1]  # [B, H]
            parents = torch.cat([last[:, None], hidden[:, width:width + t]], dim=1)  # [B, 1+T, H]
            lse = head.logsumexp(parents.reshape(batch * (1 + t), -1)).view(batch, 1 + t)
            edge_hidden = parents[:, trie.edge_parent]  # [B, E, H]
            n_edges = trie.edge_token.shape[0]
            edge_logits = head.pair_logits(edge_hidden.reshape(batch * n_edges, -1),
                                           trie.edge_token.repeat(batch)).view(batch, n_edges)
            return Scored(trie.label_scores(edge_logits - lse[:, trie.edge_parent]), [t] * batch, last)

    def full(self, model, prompt_ids, *, suffix_length=None):
        """One pass over the prompt, then each label's tokens one label at a time on that
        prompt's own cache."""
        ids = _ids(prompt_ids, self.device)
        with torch.inference_mode():
            cache = new_cache(model.config, self.device)
            for layer in cache.layers:
                if getattr(layer, "is_sliding", False):
                    layer.activate_past_recording()
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            n = ids.shape[1]
            scores = []
            for label in self.label_ids:
                total = first[label[0]]
                if len(label) > 1:
                    cont = _ids(label[:-1], self.device)
                    step = model(input_ids=cont, cache=cache, use_cache=True,
                                 position_ids=torch.arange(n, n + cont.shape[1], device=self.device)[None])
                    cache.crop(-cont.shape[1])
                    logp = torch.log_softmax(step.logits[0].float(), dim=-1)
                    rows = torch.arange(len(label) - 1, device=self.device)
                    total = total + logp[rows, torch.tensor(label[1:], device=self.device)].sum()
                scores.append(total)
            return torch.stack(scores)


@register
class PrunedTrieScorer(TrieScorer):
    """The trie's scores to `label_tolerance`, expanded best-first in rounds batched
    across the rows (`beam_prefix.engines.label_search`); exact for every label it resolves."""

    name = "pruned"
    search = "pruned"

    def __init__(self, task, label_ids, head):
        super().__init__(task, label_ids, head)
        self._exhaustive = TrieScorer(task, label_ids, head, trie=self.trie)

    def exhaustive(self) -> LabelScorer:
        return self._exhaustive

    def score(self, model, prefix, suffixes, *, working, calibration):
        trie, head = self.trie, self.head
        step = Step.suffixes(suffixes, prefix.length, self.device)
        batch = step.ids.shape[0]
        call = CallState(batch, self.device)
        search = Search(trie, batch, self.task.label_tolerance, calibration)
        with torch.inference_mode():
            with seated(working, batch, plain=True) as cache:
                hidden = forward(model, prefix, step, cache=cache, call=call)
                last = hidden[torch.arange(batch, device=self.device), step.lengths - 1]
                search.expand_root(head, last)
                column = torch.full((batch, trie.size), -1, dtype=torch.long, device=self.device)
                while True:  # one round: the chosen nodes of every row in one packed pass
                    nodes, real = search.choose()
                    if not bool(real.any()):
                        break
                    start = call.length
                    hidden = forward(model, prefix, node_step(trie, nodes, real, step, call, column,
                                                              prefix.length + step.lengths), cache=cache, call=call)
                    rows, cols = real.nonzero(as_tuple=True)
                    column[rows, nodes[rows, cols]] = start + cols  # where each node's keys sit in the call
                    search.expand(head, hidden[rows, cols], rows, nodes[rows, cols])
        return Scored(search.raw_scores(), search.expanded.sum(-1).tolist(), last)


@register
class HeadScorer(LabelScorer):
    """A trained head (`task.head`, a `trained_head.TrainedHead`) on the row's hidden
    state(s) at its last position: the suffix pass only, however many labels."""

    name = "head"
    mode = "head"

    def __init__(self, task, label_ids, head):
        super().__init__(task, label_ids, head)
        self.trained = task.head

    def score(self, model, prefix, suffixes, *, working, calibration):
        features = self.features(model, prefix, suffixes, working=working, layers=self.trained.layers,
                                 pooling=self.trained.pooling)
        return Scored(self.trained.logits(features), [0] * len(suffixes), features)

    def full(self, model, prompt_ids, *, suffix_length=None):
        """The whole prompt re-encoded with no cache; the head on its features."""
        return self.trained.logits(self.full_features(model, prompt_ids, self.trained.layers,
                                                      pooling=self.trained.pooling,
                                                      suffix_length=suffix_length)[None])[0]


def scorer_name(task, label_ids: Sequence[Sequence[int]], prefix_attention: str) -> str:
    """The `SCORERS` key for `task`: its `scoring`, where ``auto`` is first-token scoring
    when every label has its own first token, and ``sequence`` is its `label_search`, where
    ``auto`` is pruned under shared-prefix attention (on the expanded cache each round of a
    search would copy the batch-expanded prefix again in every layer)."""
    scoring = task.scoring
    if scoring == "auto":
        firsts = [ids[0] for ids in label_ids]
        scoring = "first_token" if len(set(firsts)) == len(firsts) else "sequence"
    if scoring != "sequence":
        return scoring
    if task.label_search == "auto":
        return "pruned" if prefix_attention == "shared" else "exhaustive"
    return task.label_search


def build_scorer(task, label_ids: Sequence[Sequence[int]], head: OutputHead, *, prefix_attention: str) -> LabelScorer:
    """The task's scorer (see `scorer_name`)."""
    name = scorer_name(task, label_ids, prefix_attention)
    if name not in SCORERS:
        raise ValueError(f"no label scorer {name!r}; known: {sorted(SCORERS)}")
    return SCORERS[name](task, label_ids, head)


def _ids(ids: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([list(ids)], dtype=torch.long, device=device)
