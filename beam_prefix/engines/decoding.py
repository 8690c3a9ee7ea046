"""Greedy, schema-constrained decoding over the cached prefix, and its no-cache reference.

`decode_cached` generates for a batch of rows through the one prefix-attention forward
path (`engine.forward`): the suffixes run as one packed pass, then each step runs one new
token per unfinished row. A row's suffix and generated tokens keep their keys and values
in the call's `CallState` (or, on the expanded engine, in the working cache, cropped on
exit), so a new token attends to the prefix, its own row's suffix and its own earlier
tokens, at position ``prefix + suffix + t``. A finished row has no token in later steps
(packed batches compute nothing for it). Nothing outlives the call, also when a forward
raises: the call state is a local, the working cache is cropped by `WorkingCache.use`.

`decode_full` is the reference: the row's whole prompt re-encoded and run from scratch,
then plain incremental decoding on the model's own cache, with the same constraint.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from beam_prefix.engines.constraints import RowMatchers
from beam_prefix.model.forward import CallState, Step, forward, seated
from beam_prefix.model.output_head import OutputHead
from beam_prefix.model.prefix_cache import PrefixCache, WorkingCache, new_cache

__all__ = ["Decoded", "decode_cached", "decode_full"]


@dataclasses.dataclass(frozen=True)
class Decoded:
    """One row's generated tokens.

    Attributes:
        tokens: the chosen token ids, in order (an end-of-text token included if chosen).
        finished: the output closed before `max_new_tokens` ran out.
    """

    tokens: tuple[int, ...]
    finished: bool


def decode_cached(model, head: OutputHead, prefix: PrefixCache, suffixes: Sequence[Sequence[int]],
                  matchers: RowMatchers, max_new_tokens: int, *,
                  working: WorkingCache | None = None, pick: str = "auto") -> list[Decoded]:
    """Greedy constrained decoding for each suffix (row r uses matcher r), batched.

    `pick`: how a step's tokens are chosen; ``host`` scores only the allowed tokens of rows
    with few of them (`_choose`: the CPU's way, it saves most of the vocabulary matmul),
    ``device`` masks the whole vocabulary's logits and takes their argmax on the model's
    device with one copy back per step (`RowMatchers.choose_batch`: an accelerator's way);
    ``auto``: ``host`` on the CPU, else ``device``. Both give the same tokens. Each step's
    masks are computed while the device runs that step's forward (launched first)."""
    device = head.weight.device
    if pick not in ("auto", "device", "host"):
        raise ValueError(f"pick must be 'auto', 'device' or 'host', not {pick!r}")
    on_device = pick == "device" or (pick == "auto" and torch.device(device).type != "cpu")
    step = Step.suffixes(suffixes, prefix.length, device)
    batch = step.ids.shape[0]
    ends = prefix.length + step.lengths  # position of each row's first generated token
    call = CallState(batch, device)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    with torch.inference_mode():
        with seated(working, batch, plain=True) as cache:
            hidden = forward(model, prefix, step, cache=cache, call=call)
            active = list(range(batch))
            matchers.fill(active)  # on an accelerator: while the forward runs
            last = hidden[torch.arange(batch, device=device), step.lengths - 1]  # [B, H]
            for t in range(max_new_tokens):
                if on_device:
                    chosen = matchers.choose_batch(head.logits(last[active]), active)
                else:
                    chosen = _choose(head, matchers, last, active)
                still = []
                for row, token in zip(active, chosen):
                    tokens[row].append(token)
                    if matchers.advance(row, token):
                        finished[row] = True
                    else:
                        still.append(row)
                active = still
                if not active or t + 1 == max_new_tokens:
                    break
                hidden = forward(model, prefix, _token_step(tokens, active, call, ends + t), cache=cache, call=call)
                matchers.fill(active)  # the next token's masks, while the device runs the step
                last = hidden[:, 0]
    return [Decoded(tuple(t), f) for t, f in zip(tokens, finished)]


# a row whose allowed tokens number at most this has logits computed for those tokens only
# (inside JSON structure: an enum's values, digits, `null`); otherwise over the vocabulary
SMALL_ALLOWED = 2048


def _choose(head: OutputHead, matchers: RowMatchers, last: torch.Tensor, active: list[int]) -> list[int]:
    """Each active row's greedy token among those the schema allows (after `fill`). Rows
    with few allowed tokens score only those (one matmul over the union of their sets, each
    row masked to its own), which is most steps of a JSON object; the others score the
    vocabulary."""
    allowed = {r: matchers.allowed(r) for r in active}
    small = [r for r in active if 0 < len(allowed[r]) <= SMALL_ALLOWED]
    chosen: dict[int, int] = {}
    if small:
        union = np.unique(np.concatenate([allowed[r] for r in small]))
        logits = head.logits_for(last[small], torch.from_numpy(union).to(last.device)).cpu().numpy()  # [S, U]
        for i, r in enumerate(small):
            own = np.isin(union, allowed[r], assume_unique=True)
            chosen[r] = int(union[np.flatnonzero(own)[logits[i, own].argmax()]])
    rest = [r for r in active if r not in chosen]
    if rest:
        chosen.update(zip(rest, matchers.argmax(matchers.apply(head.logits(last[rest]), rest), rest)))
    return [chosen[r] for r in active]


def _token_step(tokens: list[list[int]], active: list[int], call: CallState, positions: torch.Tensor) -> Step:
    """The latest token of each active row, ``[B, 1]``; it sees its own row's earlier tokens."""
    batch = len(tokens)
    device = positions.device
    real = torch.zeros(batch, 1, dtype=torch.bool, device=device)
    real[torch.tensor(active, dtype=torch.long, device=device)] = True
    ids = torch.tensor([[t[-1] if t else 0] for t in tokens], dtype=torch.long, device=device)
    return Step(ids=ids, positions=positions[:, None], real=real, see_new=real[:, :, None].clone(),
                see_past=call.real[:, None, :] & real[:, :, None])


def decode_full(model, prompt_ids: Sequence[int], matchers: RowMatchers, row: int,
                max_new_tokens: int) -> Decoded:
    """Reference for one row: its whole prompt run with no prefix cache, then incremental
    decoding on the model's own cache (matcher `row` of `matchers`)."""
    device = next(model.parameters()).device
    n = len(prompt_ids)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    cache = new_cache(model.config, device)
    tokens: list[int] = []
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=torch.arange(n, device=device)[None], cache=cache,
                    use_cache=True, logits_to_keep=1)
        for t in range(max_new_tokens):
            token = matchers.choose(out.logits[:, -1], [row])[0]
            tokens.append(token)
            if matchers.advance(row, token):
                return Decoded(tuple(tokens), True)
            if t + 1 == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]], device=device),
                        position_ids=torch.tensor([[n + t]], device=device), cache=cache, use_cache=True)
    return Decoded(tuple(tokens), False)
