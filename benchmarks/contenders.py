"""The loops compared by `benchmarks.speedup`, each returning one label per text.

A. `full_reencode`: the whole prompt encoded for every row, one forward each (the loop
   most users start from): `model(input_ids=prompt).logits[0, -1]`, label scores read at
   the labels' first tokens (sequence-scored tasks continue each label on that row's cache).
B. `cached_recipe`: the well-known recipe: the prefix's `DynamicCache` computed once, then
   one row at a time: its suffix with a full-width attention mask and explicit positions,
   labels read, `crop` back to the prefix.
C. `PrefixClassifier.classify`, batched (`batched`).
D. `ClassifyText` on DirectRunner, end to end, model load excluded (`classify_text`).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, Sequence

import apache_beam as beam
import torch

from beam_prefix import PrefixClassifier

__all__ = ["full_reencode", "cached_recipe", "batched", "batched_predictions", "classify_text", "timed"]


def timed(fn: Callable[[], list], rows: int) -> tuple[list, float]:
    """Run `fn` once; return its result and the milliseconds per row."""
    start = time.perf_counter()
    labels = fn()
    return labels, 1e3 * (time.perf_counter() - start) / max(rows, 1)


def _argmax_label(clf: PrefixClassifier, scores: torch.Tensor) -> str:
    return clf.task.label_names[int(torch.argmax(clf._normalise(scores)))]


def full_reencode(clf: PrefixClassifier, texts: Sequence[str]) -> list[str]:
    """A: every row's whole prompt through the model, no cache kept between rows."""
    return [p.label for p in clf.classify_full(texts)]


def cached_recipe(clf: PrefixClassifier, texts: Sequence[str]) -> list[str]:
    """B: prefix `DynamicCache` once; per row: suffix forward, read labels, crop back."""
    from transformers import DynamicCache

    model = clf.model
    prefix = torch.tensor([list(clf.layout.prefix_ids)])
    n = prefix.shape[1]
    labels = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix, cache=cache, use_cache=True)
        for text in texts:
            suffix = torch.tensor([list(clf.encode(text).suffix_ids)])
            s = suffix.shape[1]
            out = model(input_ids=suffix, cache=cache, use_cache=True,
                        attention_mask=torch.ones(1, n + s, dtype=torch.long),
                        position_ids=torch.arange(n, n + s)[None])
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            if clf.mode == "first_token":
                scores = out.logits[0, -1].float()[clf.scorer.first_ids]
            else:  # each label continued on this row's cache, then cropped off again
                scores = []
                for label in clf.label_ids:
                    total = logp[label[0]]
                    if len(label) > 1:
                        cont = torch.tensor([list(label[:-1])])
                        k = cont.shape[1]
                        step = model(input_ids=cont, cache=cache, use_cache=True,
                                     attention_mask=torch.ones(1, n + s + k, dtype=torch.long),
                                     position_ids=torch.arange(n + s, n + s + k)[None])
                        cache.crop(-k)
                        lp = torch.log_softmax(step.logits[0].float(), dim=-1)
                        total = total + lp[torch.arange(k), torch.tensor(label[1:])].sum()
                    scores.append(total)
                scores = torch.stack(scores)
            cache.crop(-s)
            labels.append(_argmax_label(clf, scores))
    return labels


def batched(clf: PrefixClassifier, texts: Sequence[str], batch_size: int) -> list[str]:
    """C: the library, `batch_size` rows per forward pass (rows sorted by length)."""
    return [p.label for p in batched_predictions(clf, texts, batch_size)]


def batched_predictions(clf: PrefixClassifier, texts: Sequence[str], batch_size: int, *,
                        exhaustive: bool = False) -> list:
    """C's predictions; with `exhaustive`, the whole label trie for every row."""
    fork = clf.fork()
    fork.batch_size = batch_size
    return fork.classify_exhaustive(texts) if exhaustive else fork.classify(texts)


# Labels collected by D's pipeline, by run: the in-memory DirectRunner runs the collecting
# step in this process, and a module-level class is unpickled by reference to this module.
_COLLECTED: dict[str, dict[int, str]] = {}
_LOCK = threading.Lock()


class _Collect(beam.DoFn):
    def __init__(self, key: str):
        self.key = key

    def process(self, row):
        with _LOCK:
            _COLLECTED.setdefault(self.key, {})[row["_index"]] = row["label"]


def classify_text(transform, rows: list[dict]) -> Callable[[], list[str]]:
    """D: a DirectRunner pipeline over `rows`; returns a function that runs it once and
    returns the labels in input order (the model comes from the process-wide handle)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    indexed = [{**r, "_index": i} for i, r in enumerate(rows)]

    def run() -> list[str]:
        key = uuid.uuid4().hex
        p = beam.Pipeline(options=PipelineOptions(["--direct_running_mode=in_memory"]))
        _ = (p | beam.Create(indexed) | transform).labeled | beam.ParDo(_Collect(key))
        p.run().wait_until_finish()
        got = _COLLECTED.pop(key, {})
        return [got.get(i, "") for i in range(len(rows))]

    return run
