"""The forward's early exit: a model's base run only up to the last layer a call reads.

A trained head or an embedding that reads hidden states no later than layer ``k`` needs
only the first ``k`` decoder layers; the rest of the model would be computed and thrown
away (a head on layers 6 and 12 of the embedded model's 30 needs 12 of them). `exit_depth`
says how many layers a forward must run for the hidden-state indices it returns, and
`shallow` gives a view of the base model that runs that many.

A view is a second `nn.Module` over the same parameters (nothing is copied): its own
module table, whose decoder-layer list holds the first ``k`` layers, and its own config
(``num_hidden_layers = k``; the k-th hidden state kept as the layer's output, not replaced
by the final normalised state, which only a full-depth forward returns). Views are made
once per (model, depth), under a lock, and read-only after: threads share them as they
share the model. Results equal the full-depth forward's at the same indices (tested for
Llama, Qwen2, GPT-2 and sliding-window models; the start-up self-check compares them with
full re-encoding, which always runs every layer).
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Sequence

from torch import nn

__all__ = ["exit_depth", "shallow", "decoder_layers"]

_VIEWS: "weakref.WeakKeyDictionary[nn.Module, dict[int, nn.Module]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def exit_depth(config, layers: Sequence[int] | None) -> int | None:
    """The decoder layers a forward returning hidden-state indices `layers` must run
    (index ``i`` is the output of layer ``i``; ``-1`` and ``L`` are the final normalised
    state), or None when it must run all ``L`` of them."""
    if layers is None:
        return None
    total = config.get_text_config().num_hidden_layers
    deepest = max(i % (total + 1) for i in layers)
    return None if deepest >= total else max(deepest, 1)  # layer 0's input is captured with its output


def shallow(base: nn.Module, depth: int) -> nn.Module:
    """A view of `base` (a transformers base model) running its first `depth` decoder layers."""
    with _LOCK:
        views = _VIEWS.setdefault(base, {})
        if depth not in views:
            views[depth] = _view(base, depth)
        return views[depth]


def decoder_layers(base: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of `base` (a transformers base model), in order."""
    return base._modules[_decoder_name(base)]


def _decoder_name(base: nn.Module) -> str:
    total = base.config.get_text_config().num_hidden_layers
    names = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m) == total]
    if len(names) != 1:
        raise ValueError(f"{type(base).__name__}: cannot tell its decoder layers (lists of {total}: {names})")
    return names[0]


def _view(base: nn.Module, depth: int) -> nn.Module:
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    name = _decoder_name(base)
    # The hidden-state hooks live on the shared layers: install them through the model once,
    # so the view (marked as hooked, copied below) never installs a second set.
    maybe_install_capturing_hooks(base)
    view = copy.copy(base)
    view._modules = dict(base._modules)
    view._modules[name] = nn.ModuleList(list(base._modules[name])[:depth])
    config = copy.copy(base.config)
    config.num_hidden_layers = depth
    config.tie_last_hidden_states = False
    view.config = config
    return view
