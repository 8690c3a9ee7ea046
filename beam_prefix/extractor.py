"""`Extractor`: structured fields out of each text, generated over the cached prefix.

It ties an `ExtractionSpec` to a loaded model the way `PrefixClassifier` does for
classification (the same `CachedPrompt`: layout, context check, prefix cache, attention
engine), compiles the task's JSON schema for the tokenizer (`JsonConstraint`), and
decodes greedily under it (`decoding.decode_cached`). `extract_full` is the no-cache
reference (the whole prompt re-encoded per row, the same constrained greedy decoding);
`verify` compares the two token for token, at start-up on probe texts.

Threads: as for `PrefixClassifier`. Under shared-prefix attention a call keeps nothing
but its locals (its matchers included), so threads may share an instance; on the
expanded engine each instance has its own working cache (`fork()` per thread) and its
calls are serialised by a lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Iterable, Sequence

from beam_prefix.cached_prompt import CachedPrompt, length_batches
from beam_prefix.classifier import VERIFY_PROBES
from beam_prefix.constraints import JsonConstraint
from beam_prefix.decoding import Decoded, decode_cached, decode_full
from beam_prefix.errors import TaskSpecError, VerificationError
from beam_prefix.extract_task import ExtractionSpec, load_task
from beam_prefix.model import EMBEDDED, LoadedModel, load_model
from beam_prefix.prompt import EncodedText
from beam_prefix.scoring import OutputHead

__all__ = ["Extractor", "Extraction"]

_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Extraction:
    """The fields extracted from one text.

    Attributes:
        values: the parsed object, every field present in task order (null where the model
            said null); None when the output did not close (`finished` False).
        raw_output: the generated text (end-of-text token left out).
        finished: the object closed within the task's `max_new_tokens`.
        generated_tokens: tokens generated for this row.
        text_tokens: tokens of the row's text before any truncation.
        truncated: whether the text was cut to the token budget.
        tokens: the generated token ids (what `verify` compares).
        problem: why a closed output is still not valid (a date the grammar cannot rule
            out, see `extract_task`); `values` is then None.
        suffix_tokens: the row's suffix tokens run over the cached prefix (before generating).
    """

    values: dict[str, Any] | None
    raw_output: str
    finished: bool
    generated_tokens: int
    text_tokens: int = 0
    truncated: bool = False
    tokens: tuple[int, ...] = dataclasses.field(default=(), repr=False)
    problem: str | None = None
    suffix_tokens: int = 0


class Extractor:
    """Extract fields from texts with a prefix-cached causal LM.

    Build with `Extractor.load(task, model=...)`, or from a loaded model with the
    keyword-only constructor; the prefix cache and the schema are built on construction.

    Args:
        task: the extraction task.
        loaded: model, tokenizer and model id.
        batch_size: rows decoded together (decoding steps are bound by reading the weights:
            a step of 64 rows costs little more than one of 16).
        max_batch_tokens: cap on rows x (suffix + max_new_tokens) per batch.
        verify: check cached against full decoding on probe texts now.
        prefix_attention: ``"auto"``, ``"shared"`` or ``"expanded"`` (see `PrefixClassifier`).
    """

    def __init__(self, *, task: ExtractionSpec, loaded: LoadedModel, batch_size: int = 64,
                 max_batch_tokens: int = 8192, verify: bool = True, prefix_attention: str = "auto",
                 _shared: "Extractor | None" = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not isinstance(task, ExtractionSpec):
            raise TaskSpecError(f"an Extractor needs an extraction task (kind: extract), got {type(task).__name__}")
        self.task = task
        self.loaded = loaded
        self.model, self.tokenizer, self.model_id = loaded.model, loaded.tokenizer, loaded.model_id
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self._lock = threading.Lock()
        self.last_check: dict[str, float] | None = None
        if _shared is not None:  # fork: everything but the working cache
            self._prompt, self.head, self.constraint = _shared._prompt, _shared.head, _shared.constraint
            self.startup = _shared.startup
        else:
            start = time.perf_counter()
            self._prompt = CachedPrompt.build(task, loaded, prefix_attention=prefix_attention)
            self.head = OutputHead(self.model)
            self.constraint = JsonConstraint(task.json_schema(), self.tokenizer, self.head.weight.shape[0])
            _LOGGER.info("prefix cache: %s; extraction of %d fields; %s prefix attention; built in %.2f s",
                         self.layout.describe(), len(task.fields), self.prefix_attention, self._prompt.build_s)
            self.startup = {"prefix_build_s": time.perf_counter() - start}
        self._working = self._prompt.working_cache()
        if verify and _shared is None:
            start = time.perf_counter()
            self.verify(VERIFY_PROBES)
            self.startup["self_check_s"] = time.perf_counter() - start
            self.startup.update(self.last_check)

    @classmethod
    def load(cls, task: ExtractionSpec | str | os.PathLike, model: str | None = None, *,
             dtype: str = "float32", threads: int | None = None, trust_remote_code: bool = False,
             **kwargs) -> "Extractor":
        """Load `model` (default: the task's, else ``"embedded"``) and build the cache."""
        if not isinstance(task, ExtractionSpec):
            task = load_task(task)
        loaded = load_model(model or task.model or EMBEDDED, dtype=dtype, threads=threads,
                            trust_remote_code=trust_remote_code)
        return cls(task=task, loaded=loaded, **kwargs)

    def fork(self) -> "Extractor":
        """Another extractor sharing model, prompt, prefix and schema, with its own working cache."""
        return Extractor(task=self.task, loaded=self.loaded, batch_size=self.batch_size,
                         max_batch_tokens=self.max_batch_tokens, verify=False, _shared=self)

    # -- the prompt's parts -------------------------------------------------------------

    @property
    def layout(self):
        return self._prompt.layout

    @property
    def prefix_cache(self):
        return self._prompt.prefix_cache

    @property
    def prefix_attention(self) -> str:
        return self._prompt.prefix_attention

    @property
    def fingerprint(self) -> str:
        return self._prompt.fingerprint

    @property
    def prefix_length(self) -> int:
        return self.prefix_cache.length

    def cache_length(self) -> int:
        """Tokens the prefix state holds between calls (the prefix length, always)."""
        return self._working.length() if self._working is not None else self.prefix_length

    # -- extraction ---------------------------------------------------------------------

    def encode(self, text) -> EncodedText:
        """Validate and encode one text (raises `RowError` with a reason for bad input)."""
        return self.layout.encode(text)

    def extract(self, texts: Sequence[str]) -> list[Extraction]:
        """Extract from texts over the cached prefix, batched. Bad texts raise `RowError`."""
        return self.extract_encoded([self.encode(t) for t in texts])

    def extract_encoded(self, encoded: Sequence[EncodedText]) -> list[Extraction]:
        """Extract from already encoded texts, in batches of similar length."""
        out: list[Extraction | None] = [None] * len(encoded)
        widths = [len(e.suffix_ids) + self.task.max_new_tokens for e in encoded]
        for batch in length_batches(widths, self.batch_size, self.max_batch_tokens):
            matchers = self.constraint.matchers(len(batch))
            # only a working cache is mutable: shared-prefix calls may run in parallel
            with self._lock if self._working is not None else contextlib.nullcontext():
                decoded = decode_cached(self.model, self.head, self.prefix_cache,
                                        [encoded[i].suffix_ids for i in batch], matchers,
                                        self.task.max_new_tokens, working=self._working)
            for i, d in zip(batch, decoded):
                out[i] = self._extraction(d, encoded[i])
        return out

    def extract_full(self, texts: Sequence[str]) -> list[Extraction]:
        """Reference: every text's whole prompt re-encoded and decoded with no prefix cache."""
        out = []
        for text in texts:
            ids, enc = self.layout.encode_full(text)
            decoded = decode_full(self.model, ids, self.constraint.matchers(1), 0, self.task.max_new_tokens)
            out.append(self._extraction(decoded, enc))
        return out

    def verify(self, texts: Iterable[str] = VERIFY_PROBES) -> None:
        """Check that cached decoding generates exactly the tokens full re-encoding does.

        Raises:
            VerificationError: naming the texts whose tokens differ.
        """
        texts = list(texts)
        self.extract(texts[:1])  # warm-up, untimed: the timings below compare steady states
        start = time.perf_counter()
        cached = self.extract(texts)
        middle = time.perf_counter()
        full = self.extract_full(texts)
        end = time.perf_counter()
        self.last_check = {"cached_ms_per_row": 1e3 * (middle - start) / max(len(texts), 1),
                           "full_ms_per_row": 1e3 * (end - middle) / max(len(texts), 1)}
        bad = [t for t, c, f in zip(texts, cached, full) if c.tokens != f.tokens]
        if bad:
            raise VerificationError(f"cached decoding differs from full re-encoding on {len(bad)} of {len(texts)} "
                                    f"texts: {[t[:60] for t in bad]}", bad)
        _LOGGER.info("verify: cached decoding == full re-encoding, token for token, on %d texts; cached %.1f ms/row, "
                     "full %.1f ms/row", len(texts), self.last_check["cached_ms_per_row"],
                     self.last_check["full_ms_per_row"])

    def _extraction(self, decoded: Decoded, enc: EncodedText) -> Extraction:
        kept = [t for t in decoded.tokens if t not in self.constraint.eos_ids]
        raw = self.tokenizer.decode(kept)
        values, problem = None, None
        if decoded.finished:
            try:  # the grammar makes it parse; the checks also know leap years
                parsed = json.loads(raw)
                self.task.check_output(parsed)
                # a number field holds floats, also where the model wrote `40`
                values = {f.name: float(parsed[f.name]) if f.type == "number" and parsed[f.name] is not None
                          else parsed[f.name] for f in self.task.fields}
            except (ValueError, TaskSpecError) as e:
                problem = str(e)
        return Extraction(values=values, raw_output=raw, finished=decoded.finished,
                          generated_tokens=len(decoded.tokens), text_tokens=enc.text_tokens,
                          truncated=enc.truncated, tokens=decoded.tokens, problem=problem,
                          suffix_tokens=len(enc.suffix_ids))
