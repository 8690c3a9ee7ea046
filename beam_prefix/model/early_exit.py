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

from beam_prefix.errors import TaskSpecError

__all__ = ["check_layers", "exit_depth", "shallow", "decoder_layers"]

_VIEWS: "weakref.WeakKeyDictionary[nn.Module, dict[int, nn.Module]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def check_layers(config, layers: Sequence[int], *, what: str = "layers", model: str | None = None) -> tuple[int, ...]:
    """`layers`, hidden-state indices of a model of ``L`` decoder layers (`config`), as
    indices ``0..L`` (``0``: the token embeddings, ``i``: layer ``i``'s output, ``-1`` and
    ``L``: the final normalised state). The one range check every path that reads hidden
    states makes (features, heads, tuning, the forward's early exit): an index past the
    model's depth would otherwise wrap around to another layer's states.

    Raises:
        TaskSpecError: an index outside ``-(L+1)..L``, or two that name the same state
            (``-1`` and ``L``), naming `what` and the valid range.
    """
    hidden = config.get_text_config().num_hidden_layers + 1  # embeddings, then each layer
    layers = tuple(layers)
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not -hidden <= i < hidden]
    of = f" for model {model}" if model else ""
    if bad:
        raise TaskSpecError(f"{what} {list(layers)}: {bad} out of range{of}, whose hidden states are indices "
                            f"-{hidden}..{hidden - 1} ({hidden - 1} layers)")
    states = [i % hidden for i in layers]
    twice = sorted({i for i in states if states.count(i) > 1})
    if twice:
        same = [i for i, s in zip(layers, states) if s in twice]
        raise TaskSpecError(f"{what} {list(layers)}: {same} name the same hidden state{of} (of {hidden - 1} "
                            f"layers); give each layer once")
    return tuple(states)


def exit_depth(config, layers: Sequence[int] | None) -> int | None:
    """The decoder layers a forward returning hidden-state indices `layers` must run
    (index ``i`` is the output of layer ``i``; ``-1`` and ``L`` are the final normalised
    state), or None when it must run all ``L`` of them.

    Raises:
        TaskSpecError: `layers` out of the model's range (`check_layers`).
    """
    if layers is None:
        return None
    total = config.get_text_config().num_hidden_layers
    deepest = max(check_layers(config, layers))
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
