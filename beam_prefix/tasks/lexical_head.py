"""`LexicalHead`: word and character n-gram evidence beside a trained head's hidden states.

A small LM's hidden states carry what a row means; the words it uses carry what it names
(an intent's own vocabulary: "top up", "PIN", "exchange rate"), and a linear model over
n-grams reads those sharply. Beside a `TrainedHead`, a lexical head adds ``alpha`` times
its log-probabilities to the hidden-state head's logits (a product of the two experts; on
Banking77 the two together beat either: benchmarks/results/feature_survey.md).

Features: each row's text (the text the engine classified, cut when truncated) as word 1-2
grams and character 2-5 grams within word boundaries, lower-cased, hashed into
``N_FEATURES`` columns each (scikit-learn's `HashingVectorizer`: stateless, so nothing but
the chosen columns is stored); only the columns seen in two or more training rows are kept
(`word_columns`, `char_columns`, ``[M_w]``, ``[M_c]``), each count becomes ``1 + ln(tf)``
times its inverse document frequency (`word_idf`, `char_idf`), and each of the two parts
is scaled to unit length. Logits: ``x @ weight.T + bias`` with ``weight [K, M_w + M_c]``.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch

from beam_prefix.errors import TaskSpecError

__all__ = ["LexicalHead", "fit_lexical", "out_of_fold", "softmax_weights", "N_FEATURES", "ALPHAS"]

N_FEATURES = 2 ** 20
WORD_NGRAMS, CHAR_NGRAMS = (1, 2), (2, 5)
ALPHAS = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0)  # the weights of the lexical evidence k-fold chooses from (benchmarks.layer_survey: never above 4)
LEXICAL_C = 10.0
# what a head file's n-gram part may hold (a loaded file is checked against them): a smoothed
# idf is 1 + ln((1 + n) / (1 + df)), under 100 for any corpus; the folds' weights are ALPHAS
MAX_IDF, MAX_BIAS, MAX_ALPHA = 100.0, 1e4, 100.0  # the lexical regression's inverse regularisation (l2-normalised rows want a weak one)


def _vectorizers():
    from sklearn.feature_extraction.text import HashingVectorizer

    common = dict(n_features=N_FEATURES, alternate_sign=False, norm=None, lowercase=True, dtype=np.float32)
    return (HashingVectorizer(analyzer="word", ngram_range=WORD_NGRAMS, **common),
            HashingVectorizer(analyzer="char_wb", ngram_range=CHAR_NGRAMS, **common))


def _counts(texts: Sequence[str]):
    """Each text's hashed word and character n-gram counts: two sparse ``[B, N_FEATURES]``."""
    word, char = _vectorizers()
    texts = list(texts)
    return word.transform(texts), char.transform(texts)


def _weigh(counts, columns: np.ndarray, idf: np.ndarray):
    """Counts of `columns` -> ``(1 + ln tf) * idf``, each row scaled to unit length: sparse ``[B, M]``."""
    from sklearn.preprocessing import normalize

    x = counts[:, columns].tocsr().astype(np.float32)
    x.data = 1.0 + np.log(x.data)
    return normalize(x.multiply(idf[None, :]).tocsr(), norm="l2", copy=False)


class LexicalHead:
    """The n-gram part of a head (see the module docstring); read-only once built.

    Args:
        word_columns, char_columns: the hashed columns kept, ``[M_w]``, ``[M_c]`` (int64).
        word_idf, char_idf: their inverse document frequencies, same shapes.
        weight: ``[K, M_w + M_c]``; bias: ``[K]``.
        alpha: how much its log-probabilities weigh beside the hidden-state head's.
    """

    def __init__(self, *, word_columns: torch.Tensor, char_columns: torch.Tensor, word_idf: torch.Tensor,
                 char_idf: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, alpha: float, where: str = "head"):
        self.word_columns, self.char_columns = word_columns.long(), char_columns.long()
        self.word_idf, self.char_idf = word_idf.float(), char_idf.float()
        # the file stores the weight in half precision: held rounded to it, so a head answers
        # the same before it is saved and after it is read
        self.weight, self.bias = weight.half().float(), bias.float()
        self.alpha = float(alpha)
        m = self.word_columns.shape[0] + self.char_columns.shape[0]
        if self.word_idf.shape != self.word_columns.shape or self.char_idf.shape != self.char_columns.shape \
                or self.weight.dim() != 2 or self.weight.shape[1] != m or self.bias.shape != (self.weight.shape[0],):
            raise TaskSpecError(f"{where}: lexical tensors of shapes that do not fit ({m} columns, weight "
                                f"{tuple(self.weight.shape)}, bias {tuple(self.bias.shape)})")
        for name, t in (("lexical_weight", self.weight), ("lexical_bias", self.bias),
                        ("lexical_word_idf", self.word_idf), ("lexical_char_idf", self.char_idf)):
            if not bool(torch.isfinite(t).all()):
                raise TaskSpecError(f"{where}: values of {name} are not finite; fit the head again")
        for t in (self.word_columns, self.char_columns):
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= N_FEATURES):
                raise TaskSpecError(f"{where}: lexical columns outside 0..{N_FEATURES - 1}")
        # finite is not enough: a huge idf or weight overflows the features' float32 products
        for name, t, top in (("lexical_word_idf", self.word_idf, MAX_IDF), ("lexical_char_idf", self.char_idf, MAX_IDF),
                             ("lexical_bias", self.bias, MAX_BIAS)):
            low = 0.0 if top == MAX_IDF else -top
            if t.numel() and (float(t.min()) < low or float(t.max()) > top):
                raise TaskSpecError(f"{where} is damaged: {name} holds values outside {low:g}..{top:g} (from "
                                    f"{float(t.min()):.3g} to {float(t.max()):.3g}); fit the head again")
        if not (0 < self.alpha <= MAX_ALPHA):
            raise TaskSpecError(f"{where} is damaged: lexical alpha must be in (0, {MAX_ALPHA:g}], got {alpha!r}; "
                                f"fit the head again")

    @property
    def labels(self) -> int:
        return int(self.weight.shape[0])

    def features(self, texts: Sequence[str]):
        """Sparse ``[B, M_w + M_c]`` weighed n-gram features of `texts`."""
        from scipy.sparse import hstack

        word, char = _counts(texts)
        return hstack([_weigh(word, self.word_columns.numpy(), self.word_idf.numpy()),
                       _weigh(char, self.char_columns.numpy(), self.char_idf.numpy())]).tocsr()

    def log_probs(self, texts: Sequence[str]) -> torch.Tensor:
        """``[B, K]`` label log-probabilities of `texts` (fp32, CPU)."""
        logits = torch.from_numpy(np.asarray(self.features(texts) @ self.weight.numpy().T, dtype=np.float32))
        return torch.log_softmax(logits + self.bias, dim=-1)

    def evidence(self, texts: Sequence[str]) -> torch.Tensor:
        """``[B, K]``: what is added to the hidden-state head's logits: alpha x log-probabilities."""
        return self.alpha * self.log_probs(texts)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The head file's tensors of this part."""
        return {"lexical_word_columns": self.word_columns, "lexical_char_columns": self.char_columns,
                "lexical_word_idf": self.word_idf, "lexical_char_idf": self.char_idf,
                "lexical_weight": self.weight.half(), "lexical_bias": self.bias}

    @classmethod
    def from_tensors(cls, tensors: dict, alpha: float, where: str) -> "LexicalHead":
        missing = [k for k in ("lexical_word_columns", "lexical_char_columns", "lexical_word_idf",
                               "lexical_char_idf", "lexical_weight", "lexical_bias") if k not in tensors]
        if missing:
            raise TaskSpecError(f"{where} is damaged: it lacks {missing}")
        return cls(word_columns=tensors["lexical_word_columns"], char_columns=tensors["lexical_char_columns"],
                   word_idf=tensors["lexical_word_idf"], char_idf=tensors["lexical_char_idf"],
                   weight=tensors["lexical_weight"], bias=tensors["lexical_bias"], alpha=alpha, where=where)

    def digest(self, h: "hashlib._Hash") -> None:
        """Feed this part into a head's identity hash."""
        for t in self.tensors().values():
            h.update(t.contiguous().numpy().tobytes())
        h.update(repr(self.alpha).encode("ascii"))


def softmax_weights(model, n_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """A fitted scikit-learn logistic regression as softmax logits over `n_labels` labels:
    ``weight [K, F]``, ``bias [K]``. Two classes come as one row (the second class's
    logit against the first's 0); a label with no row gets a logit that never wins."""
    coef, intercept = np.asarray(model.coef_, dtype=np.float32), np.asarray(model.intercept_, dtype=np.float32)
    classes = np.asarray(model.classes_)
    if coef.shape[0] == 1 and len(classes) == 2:
        coef = np.vstack([np.zeros_like(coef), coef])
        intercept = np.concatenate([np.zeros(1, dtype=np.float32), intercept])
    weight = np.zeros((n_labels, coef.shape[1]), dtype=np.float32)
    bias = np.full(n_labels, -1e4, dtype=np.float32)
    weight[classes], bias[classes] = coef, intercept
    return weight, bias


def _kept(counts, min_df: int) -> tuple[np.ndarray, np.ndarray]:
    """The columns seen in `min_df` rows or more, and their smoothed idf (as scikit-learn's)."""
    df = np.asarray((counts > 0).sum(axis=0)).ravel()
    columns = np.flatnonzero(df >= min_df)
    n = counts.shape[0]
    return columns, (np.log((1 + n) / (1 + df[columns])) + 1.0).astype(np.float32)


def fit_lexical(texts: Sequence[str], y: np.ndarray, n_labels: int, *, cv=None, min_df: int = 2):
    """Fit the n-gram regression on `texts` with label indices `y`.

    Args:
        cv: a scikit-learn splitter, or the (train, held-out) index splits themselves
            (`out_of_fold`: rows past the held-out ones only ever train).

    Returns:
        (`LexicalHead` with alpha 1, out-of-fold log-probabilities ``[N, K]`` of the rows
        held out under `cv` (None without `cv`)): what `head_fitting` weighs against the
        hidden-state head.
    """
    from sklearn.linear_model import LogisticRegression

    from scipy.sparse import hstack

    word, char = _counts(texts)
    word_columns, word_idf = _kept(word, min_df)
    char_columns, char_idf = _kept(char, min_df)
    x = hstack([_weigh(word, word_columns, word_idf), _weigh(char, char_columns, char_idf)]).tocsr()
    model = LogisticRegression(C=LEXICAL_C, max_iter=2000)
    oof = None
    if cv is not None:
        splits = list(cv.split(np.zeros(len(y)), y)) if hasattr(cv, "split") else list(cv)
        oof = out_of_fold(model, x, y, splits, n_labels)
    model.fit(x, y)
    weight, bias = softmax_weights(model, n_labels)
    head = LexicalHead(word_columns=torch.from_numpy(word_columns), char_columns=torch.from_numpy(char_columns),
                       word_idf=torch.from_numpy(word_idf), char_idf=torch.from_numpy(char_idf),
                       weight=torch.from_numpy(weight), bias=torch.from_numpy(bias), alpha=1.0)
    return head, oof


def out_of_fold(model, x, y: np.ndarray, splits, n_labels: int) -> np.ndarray:
    """Log-probabilities ``[N, K]`` of the N rows the `splits` hold out (together, rows
    ``0 .. N-1``), each from a copy of `model` fit on its split's training rows (which may
    include rows past N that are never held out: a task's label rows). A label a split
    did not train on gets the lowest float (as scikit-learn's `cross_val_predict`)."""
    from sklearn.base import clone

    scored = sum(len(held) for _, held in splits)
    out = np.full((scored, n_labels), np.finfo(np.float64).min)
    for train, held in splits:
        fitted = clone(model).fit(x[train], y[train])
        out[np.ix_(held, fitted.classes_)] = fitted.predict_log_proba(x[held])
    return out
