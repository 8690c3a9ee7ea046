"""Schema-constrained token choice, through llguidance.

`JsonConstraint` compiles a task's JSON schema once for a tokenizer. Each decoding call
takes its own `RowMatchers` (one llguidance matcher per row, copied from the compiled
one), which masks the logits to the tokens the schema allows next and advances with the
chosen token, so every finished output parses and validates (types, enums, required
fields, string lengths, dates).

Why llguidance (tried beside xgrammar on this project's CPU machine, embedded model,
a four-field schema): both compile in well under a second and compute a mask in under
half a millisecond; llguidance is one abi3 wheel with no dependencies, while xgrammar
pulls triton and a TVM runtime into every worker image. Its torch helper compiles the
mask kernel with `torch.compile` (seconds on first use), so masks are applied through its
numpy helper on a CPU copy of the logits instead.

Output is compact JSON (no optional whitespace: ``{"a":1,"b":null}``), as the few-shot
examples are written (`ExtractionSpec.render_output`). A matcher stops by itself once
the object closes; a model that picks the end-of-text token where the schema allows it
also stops the row.
"""

from __future__ import annotations

import json
import threading
from typing import Sequence

import numpy as np
import torch

__all__ = ["JsonConstraint", "RowMatchers"]


def _llguidance():
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    return llguidance


class JsonConstraint:
    """A JSON schema compiled for one tokenizer; read-only, shared by threads.

    Args:
        schema: the JSON schema (`ExtractionSpec.json_schema()`).
        tokenizer: a Hugging Face fast tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary;
            the extra ids are never allowed).
    """

    def __init__(self, schema: dict, tokenizer, vocab_size: int):
        llg = _llguidance()
        self.vocab_size = vocab_size
        self._tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                         defaults={"whitespace_flexible": False})
        self._compiled = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if self._compiled.is_error():
            raise ValueError(f"the output schema does not compile: {self._compiled.get_error()}")
        self.eos_ids = frozenset(int(t) for t in self._tokenizer.eos_tokens)
        self._lock = threading.Lock()  # copies read the compiled matcher; one at a time

    def matchers(self, rows: int) -> "RowMatchers":
        with self._lock:
            return RowMatchers([self._compiled.deep_copy() for _ in range(rows)], self)


class RowMatchers:
    """One call's matchers, one per row; a local of the call, never shared."""

    def __init__(self, matchers: list, constraint: JsonConstraint):
        self._matchers = matchers
        self._constraint = constraint
        llg = _llguidance()
        self._executor = llg.LLExecutor()
        self._bitmask = llg.numpy.allocate_token_bitmask(len(matchers), constraint.vocab_size)

    def fill(self, rows: Sequence[int]) -> None:
        """Compute the allowed-token masks of `rows` (row indices of this call) for this step."""
        llg = _llguidance()
        llg.numpy.fill_next_token_bitmask_par(self._executor, [(self._matchers[r], r) for r in rows],
                                              self._bitmask)

    def allowed(self, row: int) -> np.ndarray:
        """The token ids `row` may take next (after `fill`), ascending."""
        bits = np.unpackbits(self._bitmask[row].view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[:self._constraint.vocab_size])

    def apply(self, logits: torch.Tensor, rows: Sequence[int]) -> np.ndarray:
        """The logits ``[R, V]`` of `rows` (in that order; after `fill`) with every token the
        schema does not allow at -inf, as a float32 numpy copy."""
        masked = logits.detach().float().cpu().numpy().copy()
        _llguidance().numpy.apply_token_bitmask_inplace(masked, self._bitmask[list(rows)])
        return masked

    def mask(self, logits: torch.Tensor, rows: Sequence[int]) -> np.ndarray:
        """`fill` then `apply`."""
        self.fill(rows)
        return self.apply(logits, rows)

    def choose(self, logits: torch.Tensor, rows: Sequence[int]) -> list[int]:
        """Greedy choice among the allowed tokens: one token id per row of `rows`."""
        return self.argmax(self.mask(logits, rows), rows)

    def argmax(self, masked: np.ndarray, rows: Sequence[int]) -> list[int]:
        """The best allowed token of each row of masked logits ``[R, V]``."""
        out = []
        for i, r in enumerate(rows):
            if not np.isfinite(masked[i]).any():
                raise RuntimeError(f"the output schema allows no token here: {self._matchers[r].get_error()}")
            out.append(int(masked[i].argmax()))
        return out

    def choose_batch(self, logits: torch.Tensor, rows: Sequence[int]) -> list[int]:
        """`argmax` for logits ``[R, V]`` on any device (after `fill`), the whole batch at once
        on that device: the rows' packed masks ``[R, V / 32]`` go to it in one copy, are
        unpacked and applied there, and the chosen ids come back in one copy (no per-row
        host work: the path for accelerators, where the logits never visit the host)."""
        device = logits.device
        packed = torch.from_numpy(self._bitmask[list(rows)]).to(device, non_blocking=True)  # int32
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((packed[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]
        best = logits.float().masked_fill(~allowed, float("-inf")).max(-1)
        tokens, ok = torch.stack([best.indices, torch.isfinite(best.values).long()]).tolist()
        for r, fine in zip(rows, ok):
            if not fine:
                raise RuntimeError(f"the output schema allows no token here: {self._matchers[r].get_error()}")
        return tokens

    def stopped(self, row: int) -> bool:
        return bool(self._matchers[row].is_stopped())

    def advance(self, row: int, token: int) -> bool:
        """Feed `row` its chosen token; returns whether the row is done."""
        matcher = self._matchers[row]
        if not matcher.consume_token(token):
            raise RuntimeError(f"the output schema refused token {token}: {matcher.get_error()}")
        return matcher.is_stopped() or token in self._constraint.eos_ids
