"""`PrefixClassifier`: classification on the prefix-cached engine.

A `prefix_engine.PrefixEngine` whose answer is a label: it derives the labels' tokens
after the prompt (`labels.label_token_ids`), builds the task's label scorer once
(`label_scorers.build_scorer`: first token, the whole label trie, a pruned search of it,
or a trained head), computes the contextual-calibration offsets, and turns each row's raw
scores into a `Prediction`. `embed` gives each row's features (what a head reads). `classify_full` is the no-cache reference and `verify` compares the two.
Threads and forks: as for every engine (`prefix_engine`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Iterable, Sequence

import torch

from beam_prefix.tasks.cached_prompt import Answer
from beam_prefix.errors import NonFiniteScoreError, VerificationError
from beam_prefix.engines.label_scorers import LabelScorer, build_scorer
from beam_prefix.tasks.labels import label_token_ids
from beam_prefix.engines.prefix_engine import VERIFY_PROBES, PrefixEngine
from beam_prefix.engines.predictions import Embedding, Prediction
from beam_prefix.model.early_exit import check_layers
from beam_prefix.model.half_precision import TOLERANCE, compute_dtype, precision_name
from beam_prefix.model.loading import precision_of
from beam_prefix.tasks.prompt import EncodedText
from beam_prefix.tasks.task import TaskSpec
from beam_prefix.tasks.trained_head import EMBED_POOLINGS, feature_fingerprint

__all__ = ["PrefixClassifier", "Prediction", "Embedding", "VERIFY_PROBES"]

_LOGGER = logging.getLogger(__name__)


class PrefixClassifier(PrefixEngine):
    """Classify texts with a prefix-cached causal LM.

    Build with `PrefixClassifier.load(task, model=...)`, or from an already loaded model
    with the constructor (keyword-only). The prefix cache is computed on construction.

    Args:
        task: the task.
        loaded: model, tokenizer and model id (`beam_prefix.model.loading.load_model`).
        batch_size: rows per forward pass in `classify`.
        max_batch_tokens: cap on rows x new tokens per forward pass (memory bound).
        verify: run `verify` on a few probe texts now (cached vs full re-encoding).
        atol: tolerance on probabilities for `verify` (default: the model's precision's,
            `half_precision.TOLERANCE`: 1e-4 in float32).
        prefix_attention: how rows attend to the cached prefix. ``"shared"``: the prefix
            stays at batch 1 and attention is split prefix/new (`beam_prefix.model.attention`;
            switches an sdpa model to its sdpa-equivalent ``beam_prefix_sdpa``).
            ``"expanded"``: a per-instance `DynamicCache` seated on the batch-expanded
            prefix and cropped back after every batch (any attention implementation).
            ``"auto"`` (default): shared where the model supports it, else expanded.
        suffix_pass: ``"packed"`` (default), ``"buckets"`` or ``"graphs"`` (CUDA graphs of
            the one-pass batches, on a CUDA model): see `PrefixEngine`.
        label_search: sequence scoring's search over the label trie, ``"pruned"``,
            ``"exhaustive"`` or ``"auto"`` (pruned under shared-prefix attention; default:
            the task's `label_search`, itself ``auto`` by default). Pruned search is exact to
            `label_tolerance`: a label it never expands gets its probability from the bound
            (see `beam_prefix.engines.label_search`); every probability is within the tolerance
            of exhaustive scoring.
        label_tolerance: pruned search's stopping tolerance (default: the task's).
        check_layers: the start-up self-check compares the features at these layers
            (`verify_features`) instead of the labels: for an engine that only embeds;
            `check_pooling` is their pooling.
    """

    task_type = TaskSpec

    def __init__(self, *, task: TaskSpec, loaded, batch_size: int = 16, max_batch_tokens: int = 8192,
                 verify: bool = True, atol: float | None = None, prefix_attention: str = "auto",
                 label_search: str | None = None, label_tolerance: float | None = None,
                 check_layers: Sequence[int] | None = None, check_pooling: str = "last",
                 suffix_pass: str = "packed"):
        if label_search is not None or label_tolerance is not None:  # validated like the task file
            task = task.replace(**{k: v for k, v in (("label_search", label_search),
                                                       ("label_tolerance", label_tolerance)) if v is not None})
        self.atol = atol if atol is not None else TOLERANCE.get(compute_dtype(loaded.model), TOLERANCE[torch.bfloat16])
        self._check_layers = None if check_layers is None else tuple(check_layers)
        self._check_pooling = _check_pooling(check_pooling)
        super().__init__(task=task, loaded=loaded, batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                         verify=verify, prefix_attention=prefix_attention, suffix_pass=suffix_pass)

    @classmethod
    def _answer(cls, task: TaskSpec, layout) -> Answer:
        ids = label_token_ids(layout, task.label_names)
        identity = {"labels": list(task.label_names), "label_ids": [list(i) for i in ids]}
        if task.head is not None:  # a head answers: its weights shape the outputs
            identity["head"] = task.head.identity
        return Answer("longest label", max(len(i) for i in ids), identity)

    @classmethod
    def _check_launch(cls, task: TaskSpec, layout, answer: Answer, config, model: str, *, dtype: str,
                      layers: Sequence[int] | None) -> None:
        """A head fit for another prompt, model, dtype or labels, and hidden-state layers the
        model does not have, refused from the configuration alone (the engine's own check,
        made again on each worker, would come after the model loads)."""
        wanted = [("layers", tuple(layers))] if layers is not None else []
        if task.head is not None:
            wanted.append((f"head {task.head.source or task.head.identity}: layers", task.head.layers))
        for what, indices in wanted:
            check_layers(config, indices, what=what, model=model)
        if task.head is not None:
            cls._check_head(task, layout, answer, model, precision_of(dtype), shown=f"{model} ({dtype})")

    @staticmethod
    def _features_prompt(layout, answer: Answer, model: str) -> str:
        """The prompt's fingerprint without a head: what features depend on, and what a
        head fit on them records (`trained_head.feature_fingerprint` adds dtype, layers and
        pooling)."""
        return layout.fingerprint(model, {k: v for k, v in answer.identity.items() if k != "head"})

    @classmethod
    def _check_head(cls, task: TaskSpec, layout, answer: Answer, model: str, dtype, *, shown: str) -> None:
        """Refuse a head fit for other labels, or on another prompt, model, dtype, layers or
        pooling (at launch from the configuration, and again when the engine is built)."""
        head = task.head
        fingerprint = feature_fingerprint(cls._features_prompt(layout, answer, model), dtype, head.layers,
                                          head.pooling)
        head.check(task.label_names, fingerprint, task=task.name, model=shown)

    @property
    def features_fingerprint(self) -> str:
        """`_features_prompt` of this engine's prompt and model."""
        return self._features_prompt(self.layout, self._prompt.answer, self.model_id)

    @classmethod
    def _read_task(cls, source) -> TaskSpec:
        return source if isinstance(source, TaskSpec) else TaskSpec.from_yaml(os.fspath(source))

    def _prepare(self) -> None:
        self.label_ids = tuple(tuple(i) for i in self._prompt.answer.identity["label_ids"])
        self.scorer: LabelScorer = build_scorer(self.task, self.label_ids, self.head,
                                                prefix_attention=self.prefix_attention)
        if self.task.head is not None:  # a head reads features of this prompt, model and dtype only
            self._check_head(self.task, self.layout, self._prompt.answer, self.model_id,
                             precision_name(self.model), shown=self.model_id)
        self.mode = self.scorer.mode  # "first_token", "sequence" or "head": what a label's score is
        self.label_search = self.scorer.search  # "pruned" or "exhaustive": how much of the trie a row runs
        self._calibration: torch.Tensor | None = None
        if self.task.calibration:
            self._calibration = self._calibration_vector(self.task.calibration)
        _LOGGER.info("prefix cache: %s; %s; %s prefix attention; built in %.2f s",
                     self.layout.describe(), self._scoring_words(), self.prefix_attention, self._prompt.build_s)

    def _scoring_words(self) -> str:
        """How labels are scored, for the log (a head searches no label tokens)."""
        if self.mode == "head":
            return "trained head scoring"
        return f"{self.mode} scoring ({self.label_search} label search)"

    @property
    def label_tokens(self) -> int:
        """Tokens of the label trie: what exhaustive search runs per row in sequence mode,
        and the most that pruned search can (0 in first-token mode)."""
        return self.scorer.label_tokens

    # -- classification -------------------------------------------------------------------

    def classify(self, texts: Sequence[str]) -> list[Prediction]:
        """Classify texts over the cached prefix, batched. Bad texts raise `RowError`;
        use `classify_encoded` with `encode` to handle them one by one."""
        return self.classify_encoded([self.encode(t) for t in texts])

    def classify_encoded(self, encoded: Sequence[EncodedText], *, features: bool = False) -> list[Prediction]:
        """Classify already encoded texts (see `encode`), in batches sorted by length;
        `features`: each `Prediction` also carries the row's features (at no extra cost)."""
        return self._predictions(encoded, self.scorer, features=features)

    def embed(self, texts: Sequence[str], layers: Sequence[int] = (-1,), *, pooling: str = "last") -> list["Embedding"]:
        """Each text's features: its hidden states at its last prompt position (``mean``
        `pooling`: their mean over its suffix positions), `layers` concatenated (``-1``: the
        final normalised state); one suffix pass, no labels."""
        return self.embed_encoded([self.encode(t) for t in texts], layers=layers, pooling=pooling)

    def embed_encoded(self, encoded: Sequence[EncodedText], *, layers: Sequence[int] = (-1,),
                      pooling: str = "last") -> list["Embedding"]:
        """`embed` for already encoded texts."""
        _check_pooling(pooling)

        def run(suffixes):
            return list(self.scorer.features(self.model, self.prefix_cache, suffixes, working=self._working,
                                             layers=layers, pooling=pooling).float().cpu())

        vectors = self._each_batch(encoded, 0, run)
        return [Embedding(tuple(v.tolist()), e.text_tokens, e.truncated, len(e.suffix_ids))
                for v, e in zip(vectors, encoded)]

    def embed_full(self, texts: Sequence[str], layers: Sequence[int] = (-1,), *,
                   pooling: str = "last") -> list["Embedding"]:
        """Reference for `embed`: every text's whole prompt re-encoded with no prefix cache."""
        _check_pooling(pooling)
        out = []
        for text in texts:
            ids, enc = self.layout.encode_full(text)
            vector = self.scorer.full_features(self.model, ids, layers, pooling=pooling,
                                               suffix_length=len(enc.suffix_ids)).float().cpu()
            out.append(Embedding(tuple(vector.tolist()), enc.text_tokens, enc.truncated, len(ids)))
        return out

    def classify_exhaustive(self, texts: Sequence[str]) -> list[Prediction]:
        """Classify over the cached prefix with every label's own score (the pruned search's
        reference; the same as `classify` in first-token mode or with exhaustive search)."""
        return self._predictions([self.encode(t) for t in texts], self.scorer.exhaustive())

    def classify_full(self, texts: Sequence[str]) -> list[Prediction]:
        """Reference: every text's whole prompt re-encoded and run with no prefix cache."""
        out = []
        for text in texts:
            ids, enc = self.layout.encode_full(text)
            raw = self.scorer.full(self.model, ids, suffix_length=len(enc.suffix_ids))
            out.append(self._prediction(self._with_words(raw[None], [enc])[0], enc, len(ids),
                                        label_tokens=self.label_tokens))
        return out

    def verify(self, texts: Iterable[str] = VERIFY_PROBES) -> float:
        """Check cached scoring against full re-encoding on `texts`, and with pruned label
        search also against cached exhaustive scoring.

        Returns:
            the largest probability difference seen.
        Raises:
            VerificationError: naming the texts whose label or scores disagree.
        """
        texts = list(texts)
        try:
            cached, full = self._timed(texts, self.classify, self.classify_full)
            # (what, its scores, what they are checked against, tolerance)
            checks = [("cached scoring", cached, "full re-encoding", full, self.atol)]
            if self.scorer.exhaustive() is not self.scorer:
                # pruned search: the cache is proved by cached exhaustive scoring == full
                # re-encoding; the search by its bound (each probability within
                # label_tolerance of exhaustive scoring: label_search's docstring)
                exhaustive = self.classify_exhaustive(texts)
                checks = [("cached exhaustive scoring", exhaustive, "full re-encoding", full, self.atol),
                          ("cached scoring", cached, "exhaustive label search", exhaustive,
                           self.atol + self.task.label_tolerance)]
        except NonFiniteScoreError as e:  # a NaN compares unequal to itself: never a pass
            raise VerificationError(f"the self-check's scores are not numbers: {e}", texts) from e
        worst = 0.0
        for what, scores, name, reference, atol in checks:
            bad, diff = _disagreements(texts, scores, reference, atol)
            worst = max(worst, diff)
            if bad:
                raise VerificationError(
                    f"{what} disagrees with {name} on {len(bad)} of {len(texts)} "
                    f"texts (max probability difference {diff:.2e}, tolerance {atol:.0e}): "
                    f"{[t[:60] for t in bad]}", bad)
        _LOGGER.info("verify: cached (%s): %s on %d texts (max diff %.1e); cached %.1f ms/row, "
                     "full re-encoding %.1f ms/row", self._scoring_words(),
                     "; ".join(f"{what} == {name}" for what, _, name, _, _ in checks),
                     len(texts), worst, self.last_check["cached_ms_per_row"], self.last_check["full_ms_per_row"])
        return worst

    def verify_features(self, texts: Iterable[str] = VERIFY_PROBES, layers: Sequence[int] = (-1,), *,
                        pooling: str = "last") -> float:
        """Check cached features (`embed`) against full re-encoding on `texts`: every value
        within `atol` x the largest magnitude (hidden states are not probabilities).

        Returns:
            the largest difference seen.
        Raises:
            VerificationError: naming the texts whose features differ.
        """
        texts = list(texts)
        cached, full = self._timed(texts, lambda t: self.embed(t, layers, pooling=pooling),
                                   lambda t: self.embed_full(t, layers, pooling=pooling))
        diffs = [max(abs(a - b) for a, b in zip(c.features, f.features)) for c, f in zip(cached, full)]
        diffs = [d if math.isfinite(d) else math.inf for d in diffs]  # NaN > tolerance is False
        scale = max(abs(v) for f in full for v in f.features)
        bad = [t for t, d in zip(texts, diffs) if not d <= self.atol * max(scale, 1.0)]
        if bad:
            raise VerificationError(f"cached features differ from full re-encoding on {len(bad)} of {len(texts)} texts "
                                    f"(max difference {max(diffs):.2e}, values up to {scale:.1f}): "
                                    f"{[t[:60] for t in bad]}", bad)
        _LOGGER.info("verify: cached features == full re-encoding on %d texts (max diff %.1e of values up to %.1f)",
                     len(texts), max(diffs), scale)
        return max(diffs)

    def _self_check(self) -> None:
        if self._check_layers is not None:
            self.verify_features(VERIFY_PROBES, self._check_layers, pooling=self._check_pooling)
        else:
            self.verify(VERIFY_PROBES)

    # -- internals ------------------------------------------------------------------------

    def _predictions(self, encoded: Sequence[EncodedText], scorer: LabelScorer, *,
                     features: bool = False) -> list[Prediction]:
        raw = self._raw_cached(encoded, scorer)
        if not raw:
            return []
        # every row's scores normalised together and copied to the host once (and the
        # features once): no per-row device round trip, whatever the batch's size
        logp = self._normalise(self._with_words(torch.stack([r for r, _, _ in raw]), encoded))
        vectors = torch.stack([f for _, _, f in raw]).float().cpu().tolist() if features else None
        out = self._from_logprobs(logp, raw, encoded, [len(e.suffix_ids) + n for (_, n, _), e in zip(raw, encoded)])
        if vectors is not None:
            out = [dataclasses.replace(p, features=tuple(v)) for p, v in zip(out, vectors)]
        return out

    def _raw_cached(self, encoded: Sequence[EncodedText], scorer: LabelScorer) -> list[tuple]:
        """(raw label scores, label tokens run, features) per row, in input order."""
        def run(suffixes):
            scored = scorer.score(self.model, self.prefix_cache, suffixes, working=self._working,
                                  calibration=self._calibration)
            return list(zip(scored.raw, scored.label_tokens, scored.features))

        return self._each_batch(encoded, scorer.label_tokens, run)

    def _with_words(self, raw: torch.Tensor, encoded: Sequence[EncodedText]) -> torch.Tensor:
        """``[B, K]`` head logits plus, for a head that reads words, its lexical evidence on
        the texts the engine read (`TrainedHead.evidence`); other scores as they are."""
        if self.mode != "head":
            return raw
        evidence = self.task.head.evidence([e.text for e in encoded], raw.device)
        return raw if evidence is None else raw.float() + evidence

    def _normalise(self, raw: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` raw scores -> calibrated label log-probabilities (fp32)."""
        logp = torch.log_softmax(raw.float(), dim=-1)
        if self._calibration is not None:
            logp = torch.log_softmax(logp - self._calibration, dim=-1)
        return logp

    def _prediction(self, raw: torch.Tensor, enc: EncodedText, computed: int, *, label_tokens: int) -> Prediction:
        """One row's `Prediction` from its raw scores ``[K]`` (the no-cache reference's path)."""
        return self._from_logprobs(self._normalise(raw[None]), [(raw, label_tokens, None)], [enc], [computed])[0]

    def _from_logprobs(self, logp: torch.Tensor, raw: Sequence[tuple], encoded: Sequence[EncodedText],
                       computed: Sequence[int]) -> list[Prediction]:
        """``[B, K]`` log-probabilities (one host copy) -> each row's `Prediction`; `raw`:
        each row's (raw scores, label tokens run, features)."""
        rows = logp.tolist()
        names = self.task.label_names
        out = []
        for logs, (r, n, _), enc, done in zip(rows, raw, encoded, computed):
            if any(math.isnan(v) for v in logs):  # (log-softmax is never +inf; NaN is what breaks)
                raise NonFiniteScoreError(f"the {'head' if self.mode == 'head' else 'model'} gave this row's labels "
                                          f"scores that are not numbers: {_what_is_not_finite(r)}")
            probs = [math.exp(v) for v in logs]
            best = max(range(len(names)), key=logs.__getitem__)
            out.append(Prediction(label=names[best], score=probs[best], scores=dict(zip(names, probs)),
                                  suffix_tokens=done, logprobs=dict(zip(names, logs)),
                                  text_tokens=enc.text_tokens, truncated=enc.truncated, label_tokens=n))
        return out

    def _calibration_vector(self, texts: Sequence[str]) -> torch.Tensor:
        """Mean label log-probabilities of content-free inputs, through the same cache."""
        # content-free texts (even the empty one) bypass row validation, not the boundary check
        encoded = [EncodedText(self.layout.suffix_for(t.strip()), t.strip(), 0, False) for t in texts]
        # exhaustive: every label's own log-probability, even the far tail, which a pruned
        # search would only bound (and an offset from a bound would misweigh that label)
        raw = self._raw_cached(encoded, self.scorer.exhaustive())
        logp = torch.stack([torch.log_softmax(r.float(), dim=-1) for r, _, _ in raw])
        vector = logp.mean(0)
        _LOGGER.info("calibration over %d content-free texts: %s", len(texts),
                     {n: round(math.exp(v), 3) for n, v in zip(self.task.label_names, vector.tolist())})
        return vector


def _check_pooling(pooling: str) -> str:
    if pooling not in EMBED_POOLINGS:
        raise ValueError(f"pooling must be one of {EMBED_POOLINGS}, got {pooling!r}")
    return pooling


def _disagreements(texts, cached: Sequence[Prediction], reference: Sequence[Prediction],
                   atol: float) -> tuple[list[str], float]:
    """Texts whose scores differ by more than `atol` or whose label differs (unless the
    reference's top two are within `atol`: a tie), and the largest difference."""
    bad, worst = [], 0.0
    for text, c, f in zip(texts, cached, reference):
        diff = max(abs(c.scores[k] - f.scores[k]) for k in f.scores)
        worst = max(worst, diff) if math.isfinite(diff) else math.inf
        ranked = sorted(f.scores.values(), reverse=True)
        margin = ranked[0] - ranked[1]
        if not math.isfinite(diff) or diff > atol or (c.label != f.label and margin > atol):
            bad.append(text)
    return bad, worst


def _what_is_not_finite(raw: torch.Tensor) -> str:
    """What made a row's ``[K]`` raw scores normalise to NaN, for its failed row."""
    raw = raw.float()
    bad = ~torch.isfinite(raw)
    if bool(bad.any()):
        nan = int(torch.isnan(raw).sum())
        return f"{int(bad.sum())} of its {raw.numel()} raw scores are NaN or infinite ({nan} NaN)"
    return (f"its {raw.numel()} raw scores are finite (largest magnitude {float(raw.abs().max()):.3g}) but "
            f"normalising them gave NaN: a value past float32's range, from them or a head's n-gram part")
