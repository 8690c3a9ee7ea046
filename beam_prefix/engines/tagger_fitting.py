"""Fitting an extraction head's `SpanTagger` on labelled rows' token states, by folds.

    tagger, metrics = fit_tagger(tags, states, offsets, spans, texts, every, candidates,
                                 window=WINDOW, folds=5, search_rows=500)

Each text token's features are its windowed hidden states at some layers (`window_features`),
standardised; its target is its BIO tag (`span_tags.token_tags`). The token classifier is
one of `TAGGER_KINDS`: a multinomial logistic regression (``("linear", C)``), or one hidden
layer of GELUs (``("mlp", width)``, dropout and weight decay, a fixed number of AdamW
steps, seeded): the hidden layer finds what a linear read of the states misses where there
are thousands of rows (SNIPS' whole training file), and folds keep the linear one where
there are few. K-fold cross-validation over rows chooses the layers, the kind, and the
weight of the learned tag transitions (`TRANSITION_WEIGHTS`, `span_tags.tag_transitions`),
by entity-level micro F1 of the decoded spans (exact span and field) on the held-out rows,
every candidate decoded exactly as the head will decode (`SpanTagger.logits`,
`span_tags.best_path`). The chosen one is refit on every row.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from beam_prefix.tasks.extraction_head import SpanTagger, window_features
from beam_prefix.tasks.span_tags import TagSet, best_path, spans_of, tag_transitions, token_tags

__all__ = ["fit_tagger", "tagger_candidates", "WINDOW", "TAGGER_KINDS", "TRANSITION_WEIGHTS"]

_LOGGER = logging.getLogger(__name__)
# a token's states, and the previous and next token's (a causal state sees nothing after its
# token: the next one's says how the text goes on). Chosen on SNIPS training rows only
# (benchmarks.extraction_survey, 70 rows per intent: the best window at layers 12, 18 and 24)
WINDOW = (-1, 0, 1)
# the token classifiers the folds compare: logistic regressions (C: the classification heads'
# grid is wider) and one hidden layer, 512 wide (chosen on SNIPS training rows only: docs/history.md)
TAGGER_KINDS = (("linear", 0.1), ("linear", 1.0), ("mlp", 512))
# how much the learned tag transitions weigh beside the tokens' log-probabilities (0: none);
# each costs one more Viterbi pass per held-out row, no fit
TRANSITION_WEIGHTS = (0.0, 0.5, 1.0)
_MLP = {"dropout": 0.5, "weight_decay": 1e-3, "lr": 1e-3, "batch": 256, "epochs": 15, "min_steps": 300}


def tagger_candidates(num_layers: int) -> list[tuple[int, ...]]:
    """The tagger's layer candidates for a model of `num_layers` layers: two fifths and three
    fifths down (12 and 18 of 30), each alone and both joined (a fifth and four fifths down
    tagged SNIPS worse: docs/history.md)."""
    two = sorted({max(1, round(num_layers * f)) for f in (0.4, 0.6)})
    return [(i,) for i in two] + ([tuple(two)] if len(two) == 2 else [])


def token_data(tags: TagSet, states, offsets, spans, every, layers, window):
    """Per row: the tagger's token features ``[N, F]`` (numpy), gold tags ``[N]`` and text mask ``[N]``."""
    out = []
    for s, o, sp in zip(states, offsets, spans):
        x = window_features([s[every.index(i)] for i in layers], window).numpy()
        out.append((x, np.array(token_tags(o, sp, tags)), np.array([a >= 0 for a, _ in o])))
    return out


def entity_counts(tags: TagSet, log_probs, offsets, mask, spans, text: str,
                  transitions=None) -> tuple[int, int, int]:
    """(true positives, predicted, gold) spans of one row, exact span and field."""
    path = best_path(log_probs, tags, mask, transitions)
    found = {(f, s.start, s.end) for f, s in spans_of(path, np.exp(log_probs), offsets, tags, text).items()}
    gold = {(f, s, e) for f, (s, e) in spans.items()}
    return len(found & gold), len(found), len(gold)


def _classifier(x: np.ndarray, y: np.ndarray, size: int, kind: tuple) -> dict[str, torch.Tensor]:
    """The token classifier's tensors (`SpanTagger`'s ``weight``, ``bias`` and, for an MLP,
    ``hidden_weight``, ``hidden_bias``) fit on standardised features `x` ``[M, F]`` and
    tags `y` ``[M]``; a tag no token had gets bias -1e4 (never chosen)."""
    name, param = kind
    seen = np.unique(y)
    if name == "linear":
        from sklearn.linear_model import LogisticRegression

        model = LogisticRegression(C=param, max_iter=1000).fit(x, y)
        coef, intercept = model.coef_, model.intercept_
        if len(model.classes_) == 2:  # sklearn's binary form: one row, the second class's logit
            coef, intercept = np.concatenate([-coef / 2, coef / 2]), np.array([-intercept[0] / 2, intercept[0] / 2])
        weight = np.zeros((size, x.shape[1]), dtype=np.float32)
        bias = np.full(size, -1e4, dtype=np.float32)
        weight[model.classes_], bias[model.classes_] = coef, intercept
        return {"weight": torch.from_numpy(weight), "bias": torch.from_numpy(bias)}
    features, targets = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
    with torch.random.fork_rng(devices=[]):  # seeded, and the caller's generator untouched
        torch.manual_seed(0)
        hidden, out = torch.nn.Linear(x.shape[1], param), torch.nn.Linear(param, size)
        drop = torch.nn.Dropout(_MLP["dropout"])
        params = [*hidden.parameters(), *out.parameters()]
        opt = torch.optim.AdamW(params, lr=_MLP["lr"], weight_decay=_MLP["weight_decay"])
        per_epoch = -(-len(x) // _MLP["batch"])
        steps = max(_MLP["epochs"] * per_epoch, _MLP["min_steps"])
        order = torch.randperm(len(x))
        for step in range(steps):
            if step and step % per_epoch == 0:
                order = torch.randperm(len(x))
            batch = order[(step % per_epoch) * _MLP["batch"]:][:_MLP["batch"]]
            logits = out(drop(torch.nn.functional.gelu(hidden(drop(features[batch])))))
            loss = torch.nn.functional.cross_entropy(logits, targets[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    bias = torch.full((size,), -1e4)
    bias[torch.from_numpy(seen)] = out.bias.detach()[torch.from_numpy(seen)]
    return {"weight": out.weight.detach().clone(), "bias": bias, "hidden_weight": hidden.weight.detach().clone(),
            "hidden_bias": hidden.bias.detach().clone()}


def _tagger(tags: TagSet, data, layers, window, kind, weight: float) -> SpanTagger:
    """A `SpanTagger` fit on rows' `token_data`: standardisation, classifier and transitions."""
    x = np.concatenate([d[0][d[2]] for d in data])
    y = np.concatenate([d[1][d[2]] for d in data])
    mean, std = x.mean(0), x.std(0)
    std[std < 1e-6] = 1.0
    learned = tag_transitions([d[1][d[2]] for d in data], tags.size)
    return SpanTagger(fields=tags.fields, layers=layers, window=window,
                      mean=torch.from_numpy(mean.astype(np.float32)), std=torch.from_numpy(std.astype(np.float32)),
                      transitions=torch.from_numpy((weight * learned).astype(np.float32)),
                      **_classifier((x - mean) / std, y, tags.size, kind))


def _log_probs(tagger: SpanTagger, features: np.ndarray) -> np.ndarray:
    """``[N, T]`` a row's tag log-probabilities, as the head computes them."""
    return torch.log_softmax(tagger.logits(torch.from_numpy(features)), -1).numpy()


def _describe(kind: tuple) -> str:
    return f"C {kind[1]}" if kind[0] == "linear" else f"mlp {kind[1]}"


def fit_tagger(tags: TagSet, states, offsets, spans, texts, every, candidates, *, window=WINDOW, folds: int = 5,
               search_rows: int = 500, kinds=TAGGER_KINDS) -> tuple[SpanTagger, dict]:
    """The tagger the folds choose (module docstring), refit on every row, and what it measured.

    Args:
        tags: the span fields' tags.
        states: per row, its suffix states at the layers `every` lists (``[N_i, H]`` each).
        offsets: per row, its tokens' `PromptLayout.text_offsets`.
        spans: per row, field -> character ``(start, end)``.
        texts: per row, the text as the engine reads it.
        candidates: the layer sets to compare (`tagger_candidates`).
        window: token offsets a token's features join.
        folds: k of the k-fold search (fewer with fewer rows; under 2: the first candidate
            and kind, no transitions).
        search_rows: at most this many rows (the first) are searched.
        kinds: the token classifiers to compare (`TAGGER_KINDS`'s form).
    """
    kinds = tuple(tuple(k) for k in kinds)
    searched = min(len(states), search_rows)
    k = min(folds, searched)
    scores: dict = {}
    if k >= 2:
        from sklearn.model_selection import KFold

        splits = list(KFold(n_splits=k, shuffle=True, random_state=0).split(np.arange(searched)))
        for layers in candidates:
            data = token_data(tags, states[:searched], offsets[:searched], spans[:searched], every, layers, window)
            for kind in kinds:
                counts = {w: np.zeros(3, dtype=np.int64) for w in TRANSITION_WEIGHTS}
                for train, test in splits:
                    tagger = _tagger(tags, [data[i] for i in train], layers, window, kind, 1.0)
                    learned = tagger.transitions.numpy()
                    for i in test:
                        row_log_probs = _log_probs(tagger, data[i][0])
                        for w in TRANSITION_WEIGHTS:
                            counts[w] += entity_counts(tags, row_log_probs, offsets[i], data[i][2], spans[i], texts[i],
                                                       w * learned if w else None)
                for w, (tp, predicted, gold) in counts.items():
                    scores[layers, kind, w] = 2 * tp / max(predicted + gold, 1)
                    _LOGGER.info("tagger layers %s %s transitions x%s: %d-fold span F1 %.4f", list(layers),
                                 _describe(kind), w, k, scores[layers, kind, w])
        # ties: fewer and shallower layers (cheaper), then the earlier kind (linear, more
        # regularised), then plainer paths
        layers, kind, w = max(scores, key=lambda key: (scores[key], -len(key[0]), -key[0][0],
                                                       -kinds.index(key[1]), -key[2]))
    else:
        layers, kind, w = candidates[0], kinds[0], 0.0
    data = token_data(tags, states, offsets, spans, every, layers, window)
    tagger = _tagger(tags, data, layers, window, kind, w)
    metrics = {"layers": list(layers), "window": list(window), "kind": kind[0],
               **({"C": kind[1]} if kind[0] == "linear" else {"hidden": kind[1]}), "transition_weight": w,
               "folds": k if k >= 2 else 0, "search_rows": searched,
               "kfold_span_f1": round(scores[layers, kind, w], 4) if scores else None,
               "kfold_span_f1_by_candidate": {f"layers {list(l)} {_describe(kk)} transitions x{ww}": round(v, 4)
                                              for (l, kk, ww), v in scores.items()}}
    return tagger, metrics
