"""`Extractor`: structured fields out of each text, over the cached prefix.

A `prefix_engine.PrefixEngine` whose answer is a JSON object. With ``scoring: generate``
(the default) it compiles the task's JSON schema for the tokenizer once (`JsonConstraint`)
and decodes greedily under it (`decoding.decode_cached`). With ``scoring: head`` nothing
is decoded: the suffix pass's hidden states at the row's tokens go through the task's
`extraction_head.ExtractionHead` (spans tagged per token, enum and boolean fields
classified), the same single forward a classifier runs. `extract_full` is the no-cache
reference (the whole prompt re-encoded per row, then the same decoding or the same
head); `verify` compares the two, at start-up on probe texts: generated tokens
identical, or the head's logits within the dtype's tolerance and the same values.
Threads and forks: as for every engine; a call's matchers are its own locals.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterable, Sequence

import torch

from beam_prefix.tasks.cached_prompt import Answer
from beam_prefix.engines.constraints import JsonConstraint
from beam_prefix.engines.decoding import Decoded, decode_cached, decode_full
from beam_prefix.engines.field_reading import FieldReader, features_identity, read_fields
from beam_prefix.engines.suffix_states import full_states, suffix_states
from beam_prefix.errors import TaskSpecError, VerificationError
from beam_prefix.model.half_precision import HALF_DTYPES, TOLERANCE, compute_dtype, precision_name
from beam_prefix.model.loading import precision_of
from beam_prefix.tasks.extract_task import ExtractionSpec, load_task
from beam_prefix.engines.prefix_engine import VERIFY_PROBES, PrefixEngine
from beam_prefix.tasks.prompt import EncodedText
from beam_prefix.tasks.trained_head import feature_fingerprint

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
        logits: with a head, its logits (tags per token, then each field head's), what
            `verify` compares.
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
    logits: Any = dataclasses.field(default=None, repr=False, compare=False)


class Extractor(PrefixEngine):
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

    task_type = ExtractionSpec

    def __init__(self, *, task: ExtractionSpec, loaded, batch_size: int = 64, max_batch_tokens: int = 8192,
                 verify: bool = True, prefix_attention: str = "auto"):
        if not isinstance(task, ExtractionSpec):
            raise TaskSpecError(f"an Extractor needs an extraction task (kind: extract), got {type(task).__name__}")
        super().__init__(task=task, loaded=loaded, batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                         verify=verify, prefix_attention=prefix_attention)

    @classmethod
    def _answer(cls, task: ExtractionSpec, layout) -> Answer:
        if task.scoring == "head":  # nothing follows the suffix; the head's weights shape the outputs
            return Answer("nothing (a head reads the suffix)", 0,
                          {**features_identity(task), "head": task.head.identity})
        # the output schema and the decoding budget shape what is generated
        return Answer("max_new_tokens", task.max_new_tokens,
                      {"kind": task.kind, "schema": task.json_schema(), "max_new_tokens": task.max_new_tokens})

    @classmethod
    def _check_launch(cls, task: ExtractionSpec, layout, answer: Answer, config, model: str, *, dtype: str,
                      layers=None) -> None:
        """A head fit for other fields, or on another prompt, model or dtype, refused from the
        configuration alone (before any worker loads the model)."""
        if task.scoring == "head":
            from beam_prefix.model.early_exit import check_layers

            check_layers(config, task.head.layers, what=f"head {task.head.source or task.head.identity}: layers",
                         model=model)
            cls._check_head(task, layout, model, precision_of(dtype), shown=f"{model} ({dtype})")

    @staticmethod
    def _check_head(task: ExtractionSpec, layout, model: str, dtype, *, shown: str) -> None:
        fingerprint = feature_fingerprint(layout.fingerprint(model, features_identity(task)), dtype, ())
        task.head.check(task.fields, fingerprint, task=task.name, model=shown)

    @property
    def features_fingerprint(self) -> str:
        """What a head fit on this engine's states records: its prompt, model and dtype."""
        return feature_fingerprint(self.layout.fingerprint(self.model_id, features_identity(self.task)),
                                   precision_name(self.model), ())

    @classmethod
    def _read_task(cls, source) -> ExtractionSpec:
        task = source if isinstance(source, ExtractionSpec) else load_task(os.fspath(source))
        if not isinstance(task, ExtractionSpec):
            raise TaskSpecError(f"an Extractor needs an extraction task (kind: extract), got {type(task).__name__}")
        return task

    def _prepare(self) -> None:
        self.reader: FieldReader | None = None
        self.constraint: JsonConstraint | None = None
        if self.task.scoring == "head":  # a head reads states of this prompt, model and dtype only
            self._check_head(self.task, self.layout, self.model_id, precision_name(self.model), shown=self.model_id)
            self.reader = FieldReader(self.task)
            self.atol = TOLERANCE.get(compute_dtype(self.model), TOLERANCE[torch.bfloat16])
        else:
            self.constraint = JsonConstraint(self.task.json_schema(), self.tokenizer, self.head.weight.shape[0])
        _LOGGER.info("prefix cache: %s; extraction of %d fields by %s; %s prefix attention; built in %.2f s",
                     self.layout.describe(), len(self.task.fields),
                     "a trained head" if self.reader else "constrained decoding", self.prefix_attention,
                     self._prompt.build_s)

    # -- hidden states (a head's input, and what fitting one reads) --------------------------

    def states_encoded(self, encoded: Sequence[EncodedText], layers: Sequence[int]) -> list[tuple]:
        """Each row's hidden states at its suffix tokens, ``[N_i, H]`` per index of `layers`,
        float32 on the CPU, where a head reads them: one suffix pass per batch over the cached
        prefix, and one copy to the host per batch and layer (not per row: on a GPU each
        copy waits for the device)."""
        def run(suffixes):
            states, step = suffix_states(self.model, self.prefix_cache, suffixes, working=self._working,
                                         layers=tuple(layers), device=self.device)
            lengths = step.lengths.tolist()
            on_host = [s.float().cpu() for s in states]
            return [tuple(s[i, :n] for s in on_host) for i, n in enumerate(lengths)]

        return self._each_batch(encoded, 0, run)

    def states_full(self, text: str, layers: Sequence[int]) -> tuple:
        """The reference of `states_encoded` for one text: its whole prompt re-encoded with
        no cache, the states at the positions of its suffix (float32, on the CPU)."""
        ids, enc = self.layout.encode_full(text)
        n = len(enc.suffix_ids)
        return tuple(s[-n:].float().cpu() for s in full_states(self.model, ids, tuple(layers), self.device))

    # -- extraction ---------------------------------------------------------------------

    def extract(self, texts: Sequence[str]) -> list[Extraction]:
        """Extract from texts over the cached prefix, batched. Bad texts raise `RowError`."""
        return self.extract_encoded([self.encode(t) for t in texts])

    def extract_encoded(self, encoded: Sequence[EncodedText]) -> list[Extraction]:
        """Extract from already encoded texts, in batches of similar length."""
        if self.reader is not None:
            states = self.states_encoded(encoded, self.task.head.layers)
            return [self._read(s, e) for s, e in zip(states, encoded)]

        def run(suffixes):
            return decode_cached(self.model, self.head, self.prefix_cache, suffixes,
                                 self.constraint.matchers(len(suffixes)), self.task.max_new_tokens,
                                 working=self._working)

        decoded = self._each_batch(encoded, self.task.max_new_tokens, run)
        return [self._extraction(d, e) for d, e in zip(decoded, encoded)]

    def extract_full(self, texts: Sequence[str]) -> list[Extraction]:
        """Reference: every text's whole prompt re-encoded and decoded with no prefix cache."""
        out = []
        for text in texts:
            if self.reader is not None:
                out.append(self._read(self.states_full(text, self.task.head.layers), self.encode(text)))
                continue
            ids, enc = self.layout.encode_full(text)
            decoded = decode_full(self.model, ids, self.constraint.matchers(1), 0, self.task.max_new_tokens)
            out.append(self._extraction(decoded, enc))
        return out

    def verify(self, texts: Iterable[str] = VERIFY_PROBES) -> None:
        """Check that cached decoding generates exactly the tokens full re-encoding does (a
        head: its logits within `atol` and the same values).

        Raises:
            VerificationError: naming the texts whose tokens (or values) differ.
        """
        texts = list(texts)
        cached, full = self._timed(texts, self.extract, self.extract_full)
        if self.reader is not None:
            self._verify_head(texts, cached, full)
            return
        bad = [t for t, c, f in zip(texts, cached, full) if c.tokens != f.tokens]
        if bad:
            half = compute_dtype(self.model) in HALF_DTYPES  # rounding that flips near-tied tokens
            raise VerificationError(f"cached decoding differs from full re-encoding on {len(bad)} of {len(texts)} "
                                    f"texts: {[t[:60] for t in bad]}"
                                    + (f"; in {precision_name(self.model)} the GEMMs' rounding differs between the two "
                                       f"and greedy decoding follows it at near-tied tokens (benchmarks.precision): "
                                       f"extract in float32" if half else ""), bad)
        _LOGGER.info("verify: cached decoding == full re-encoding, token for token, on %d texts; cached %.1f ms/row, "
                     "full %.1f ms/row", len(texts), self.last_check["cached_ms_per_row"],
                     self.last_check["full_ms_per_row"])

    def _verify_head(self, texts: list, cached: list, full: list) -> None:
        worst = max(float((c.logits - f.logits).abs().max()) for c, f in zip(cached, full))
        bad = [t for t, c, f in zip(texts, cached, full) if c.values != f.values]
        if bad or worst > self.atol:
            raise VerificationError(f"the head's logits over cached states differ from full re-encoding by {worst:.2e} "
                                    f"(tolerance {self.atol:.0e} in {precision_name(self.model)}); values differ on "
                                    f"{len(bad)} of {len(texts)} texts: {[t[:60] for t in bad]}", bad)
        _LOGGER.info("verify: the head over cached states == full re-encoding on %d texts (max |logit diff| %.1e); "
                     "cached %.1f ms/row, full %.1f ms/row", len(texts), worst, self.last_check["cached_ms_per_row"],
                     self.last_check["full_ms_per_row"])

    def _read(self, states: tuple, enc: EncodedText) -> Extraction:
        """A row's fields read by the head from its suffix states (`field_reading`)."""
        read = read_fields(self.reader, states, self.layout.text_offsets(enc), enc.text)
        return Extraction(values=read.values, raw_output=read.raw_output, finished=True, generated_tokens=0,
                          text_tokens=enc.text_tokens, truncated=enc.truncated, suffix_tokens=len(enc.suffix_ids),
                          logits=read.logits)

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
