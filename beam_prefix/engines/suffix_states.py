"""A batch's hidden states at its rows' suffix tokens: what features and heads read.

`suffix_states` runs the rows' suffixes over the cached prefix (the one forward path,
`model.forward`) and returns the states at the layers asked for, ``[B, Q, H]`` each, with
the step (its `real` mask says which columns are tokens). `full_states` is its no-cache
reference: one whole prompt re-encoded, ``[T, H]`` per layer, whose last positions are
the row's suffix. A classifier pools them into a row's features (`label_scorers.pool`);
an extraction head reads every token's (`extraction_head.SpanTagger`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from beam_prefix.model.early_exit import check_layers
from beam_prefix.model.forward import Step, forward, seated
from beam_prefix.model.prefix_cache import PrefixCache, WorkingCache

__all__ = ["suffix_states", "full_states"]


def suffix_states(model, prefix: PrefixCache, suffixes: Sequence[Sequence[int]], *, working: WorkingCache | None,
                  layers: Sequence[int], device) -> tuple[tuple[torch.Tensor, ...], Step]:
    """The hidden states ``[B, Q, H]`` at `layers` (indices into the model's hidden states;
    ``-1`` the final normalised one) of a batch of suffixes run over `prefix`, and their
    step. `working`: the expanded engine's working cache (None: shared-prefix attention),
    cropped back to the prefix on return, also when the forward raises."""
    step = Step.suffixes(suffixes, prefix.length, device)
    with torch.inference_mode():
        with seated(working, len(suffixes)) as cache:
            states = forward(model, prefix, step, cache=cache, layers=layers)
    return states, step


def full_states(model, prompt_ids: Sequence[int], layers: Sequence[int], device) -> tuple[torch.Tensor, ...]:
    """The reference of `suffix_states` for one whole prompt re-encoded with no cache:
    ``[T, H]`` at each of `layers`, over all `T` prompt tokens."""
    layers = check_layers(model.config, layers)  # (an index past the depth would wrap around)
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        states = model.base_model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    return tuple(states[i][0] for i in layers)
