"""The one forward path over the cached prefix, shared by every way of scoring.

A `Step` is the new tokens of one forward pass for a batch of rows, in the padded layout
``[B, Q]``, with who sees whom among them. `forward` runs it over the prefix and returns
the hidden states ``[B, Q, H]``; exhaustive label scoring runs one step (suffix and label
trie together), pruned label search runs several (the suffix, then rounds of trie nodes).

A step may attend to tokens that earlier steps of the same call computed (a row's suffix,
the label-trie nodes already expanded for it): the `CallState` of the call remembers
their positions and, under shared-prefix attention, their keys and values per layer. It
is a local of the call: created for it, dropped with it (also when a forward raises),
never shared between calls or threads. On the expanded engine the call's tokens live in
the working cache instead, which `WorkingCache.use` crops back to the prefix on exit.

Masks are boolean (True = attend) per layer kind, ``[B, 1, Q, cols]`` where the columns
are ``[prefix | call's earlier tokens | this step]``; the prefix columns are left out
under shared-prefix attention where the whole prefix is visible (no window).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache

from beam_prefix.model.attention import SHARED_SDPA, Packing, prefix_kwargs
from beam_prefix.model.early_exit import exit_depth, shallow
from beam_prefix.model.prefix_cache import PrefixCache, WorkingCache
from beam_prefix.model.suffix_graphs import bucket

__all__ = ["Step", "CallState", "forward", "seated"]


@dataclasses.dataclass(frozen=True)
class Step:
    """New tokens of one forward pass, padded layout.

    Attributes:
        ids: ``[B, Q]`` token ids (anything at pad columns).
        positions: ``[B, Q]`` absolute positions (the prefix has ``0 .. P-1``).
        real: ``[B, Q]`` bool, which columns are tokens.
        see_new: ``[B, Q, Q]`` bool, query column sees key column of the same step (a
            real token sees itself).
        see_past: ``[B, Q, N]`` bool, query column sees the call's earlier token n; None
            when the call has none.
        causal: the step is plain causal suffixes with nothing earlier (the expanded
            engine then passes a 2-D mask, which any attention implementation takes).
    """

    ids: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    see_new: torch.Tensor
    see_past: torch.Tensor | None = None
    causal: bool = False

    @classmethod
    def suffixes(cls, rows, start: int, device: torch.device | str) -> "Step":
        """Each row's token ids (a sequence of ints), causal, from position `start`, on `device`."""
        width = max(len(r) for r in rows)
        # one host-to-device copy each for the ids and the lengths
        ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
        col = torch.arange(width, device=device)
        real = col[None] < lengths[:, None]
        causal = col[:, None] >= col[None, :]
        see = causal[None] & real[:, None, :] & real[:, :, None]
        positions = (start + col)[None].expand(len(rows), -1)
        return cls(ids=ids, positions=positions, real=real, see_new=see, causal=True)

    @property
    def lengths(self) -> torch.Tensor:
        return self.real.sum(-1)

    def with_tree(self, tokens: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor) -> "Step":
        """This (causal, suffix) step with a tree of nodes after every row:
        ``[suffix | pad | nodes]``, each node seeing its row's real suffix and its own
        ancestors (tree attention), at position suffix end + depth.

        Args:
            tokens: ``[T]`` the nodes' token ids; depth: ``[T]`` (0 = right after the
                suffix); ancestors: ``[T, T]`` bool, node k is node q itself or above it.
        """
        batch, width = self.ids.shape
        t = tokens.shape[0]
        q = width + t
        see = torch.zeros(batch, q, q, dtype=torch.bool, device=self.ids.device)
        see[:, :width, :width] = self.see_new
        see[:, width:, :width] = self.real[:, None, :]
        see[:, width:, width:] = ancestors[None]
        start = self.positions[:, :1]
        return Step(ids=torch.cat([self.ids, tokens[None].expand(batch, -1)], dim=1),
                    positions=torch.cat([self.positions, start + self.lengths[:, None] + depth[None]], dim=1),
                    real=torch.cat([self.real, torch.ones(batch, t, dtype=torch.bool, device=self.ids.device)], dim=1),
                    see_new=see)


class CallState:
    """The tokens one call has computed so far, beyond the prefix (padded layout ``[B, N]``).

    Attributes:
        positions: ``[B, N]`` positions of the earlier tokens.
        real: ``[B, N]`` bool, which of them are tokens (not pad columns).
    Under shared-prefix attention it also holds, per layer, their keys and values
    ``[B, KV, N, D]``, recorded by the attention function as each layer runs.
    """

    def __init__(self, batch: int, device: torch.device | str):
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.real = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        return int(self.positions.shape[1])

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._layers.get(layer)

    def record(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys/values ``[B, KV, Q, D]`` of the running step; visible from the next step."""
        self._pending[layer] = (keys, values)

    def commit(self, step: Step) -> None:
        """The step ran to the end: its tokens become earlier tokens of the call."""
        for layer, (k, v) in self._pending.items():
            old = self._layers.get(layer)
            self._layers[layer] = (k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
        self._pending.clear()
        self.positions = torch.cat([self.positions, step.positions], dim=1)
        self.real = torch.cat([self.real, step.real], dim=1)


@contextlib.contextmanager
def seated(working: WorkingCache | None, batch: int, *, plain: bool = False) -> Iterator[DynamicCache | None]:
    """The cache a call's forward passes run on: None under shared-prefix attention (the
    call stores nothing), else `working` seated on the prefix for `batch` rows, cropped
    back to the prefix on exit, also when a forward raises (`WorkingCache.use`; `plain`:
    several passes in one call, windows applied by the masks)."""
    if working is None:
        yield None
        return
    with working.use(batch, plain=plain) as cache:
        yield cache


def forward(model, prefix: PrefixCache, step: Step, *, cache=None, call: CallState | None = None,
            layers: Sequence[int] | None = None):
    """Run `step` over the prefix; returns hidden states ``[B, Q, H]`` (zeros at pad
    columns under shared-prefix attention), or with `layers` a tuple of them, one per
    index into the model's hidden states (``-1``: the final normalised state, as returned
    without `layers`; ``i``: the output of layer ``i``).

    With `cache` None the model must use `attention.SHARED_SDPA`: the batch runs packed
    (no pad token goes through the model) and attends to the batch-1 prefix directly.
    Otherwise `cache` is a working cache seated on the expanded prefix (and holding the
    call's earlier tokens, if any), and this step's tokens are appended to it.
    With `call`, the step sees the call's earlier tokens through `step.see_past` and
    becomes part of them when it returns. With `layers` that end before the last layer, only
    the layers up to the deepest of them run (`early_exit`).
    """
    if call is not None and call.length and step.see_past is None:
        raise ValueError("the call has earlier tokens: the step must say which it sees (see_past)")
    every = layers is not None and tuple(layers) != (-1,)  # the model's hidden states, not only the last
    base = model.base_model
    depth = exit_depth(model.config, layers)
    if depth is not None:
        base = shallow(base, depth)  # its hidden states are indexed 0..depth
        layers = [i % (model.config.get_text_config().num_hidden_layers + 1) for i in layers]
    if cache is None and call is None and prefix.graphs is not None:
        read = tuple(sorted(set(layers))) if every else None
        states = _bucketed(model, base, prefix, step, read)
        return states[0] if layers is None else tuple(states[read.index(i)] if every else states[0] for i in layers)
    if cache is None:
        masks = _masks(model, prefix, step, call, shared=True)
        packing = Packing.of_real(step.real)
        out = _shared_pass(base, prefix, packing.pack(step.ids), packing.pack(step.positions), masks, packing,
                           call, every)
        unpack = packing.unpack
    else:
        if step.causal and call is None:
            # 2-D, any attention implementation; it must span cached + new tokens
            masks = torch.cat([torch.ones(step.ids.shape[0], cache.get_seq_length(), dtype=torch.long,
                                          device=step.ids.device), step.real.long()], dim=1)
        else:
            masks = _masks(model, prefix, step, call, shared=False)
        out = base(input_ids=step.ids, attention_mask=masks, position_ids=step.positions,
                               cache=cache, use_cache=True, output_hidden_states=every)
        unpack = _as_is
    if call is not None:
        call.commit(step)
    if layers is None:
        return unpack(out.last_hidden_state)
    states = out.hidden_states if every else (out.last_hidden_state,)
    return tuple(unpack(states[i] if every else states[0]) for i in layers)


def _as_is(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _shared_pass(base, prefix: PrefixCache, ids: torch.Tensor, positions: torch.Tensor, masks, packing: Packing,
                 call: CallState | None, every: bool):
    """The base model over a packed batch ``[1, T]`` under shared-prefix attention."""
    return base(input_ids=ids, attention_mask=masks, position_ids=positions, use_cache=False,
                output_hidden_states=every, **prefix_kwargs(prefix.layers, packing, call))


def _bucketed(model, base, prefix: PrefixCache, step: Step, read: tuple[int, ...] | None) -> tuple[torch.Tensor, ...]:
    """A one-pass step padded to its bucket's fixed shape and run dense, replayed as a CUDA
    graph where the prefix records them (`suffix_graphs`). Returns the hidden states the
    packed path returns, ``[B, Q, H]`` each, zeros at pad columns: those at indices `read`,
    or the last one (None). Only these are a graph's outputs, which it keeps allocated."""
    batch, width = step.ids.shape
    rows, cols = bucket(batch), bucket(width)
    padded = _pad_step(step, rows, cols, prefix.length)
    masks = _masks(model, prefix, padded, None, shared=True)
    kinds = sorted(masks) if isinstance(masks, dict) else None
    inputs = {"ids": padded.ids.reshape(1, -1), "positions": padded.positions.reshape(1, -1)}
    inputs.update({f"mask {k}": masks[k] for k in kinds} if kinds else {"mask": masks})
    packing = Packing.dense_of(rows, cols, step.ids.device)

    def run_pass(ids, positions, **mask_inputs):
        given = {k: mask_inputs[f"mask {k}"] for k in kinds} if kinds else mask_inputs["mask"]
        out = _shared_pass(base, prefix, ids, positions, given, packing, None, read is not None)
        return (out.last_hidden_state,) if read is None else tuple(out.hidden_states[i] for i in read)

    # a sliding window's prefix part asks the host which prefix columns some query cannot see
    capturable = all(state.sliding_window is None for state in prefix.layers)
    outputs = prefix.graphs.run((base, read, rows, cols, tuple(kinds or ())), inputs, run_pass, capturable)
    real = step.real[..., None]
    return tuple(torch.where(real, out.view(rows, cols, -1)[:batch, :width], 0) for out in outputs)


def _pad_step(step: Step, rows: int, cols: int, start: int) -> Step:
    """`step` (nothing earlier in its call) padded to ``[rows, cols]``: the new columns and
    rows are pad (not real, seeing nothing of the step; the masks let each see itself), at
    position `start`, which every model has."""
    batch, width = step.ids.shape

    def grown(t: torch.Tensor, shape: tuple, fill) -> torch.Tensor:
        out = t.new_full(shape, fill)
        out[tuple(slice(0, n) for n in t.shape)] = t
        return out

    return Step(ids=grown(step.ids, (rows, cols), 0), positions=grown(step.positions, (rows, cols), start),
                real=grown(step.real, (rows, cols), False), see_new=grown(step.see_new, (rows, cols, cols), False))


def _masks(model, prefix: PrefixCache, step: Step, call: CallState | None, *, shared: bool):
    """Boolean masks per layer kind (see the module docstring); a single tensor when the
    model has one kind. Pad columns attend only to themselves (never an empty row, which
    would put NaNs into the hidden states). The prefix is visible to all, limited by the
    window on sliding layers, by position."""
    batch, q = step.ids.shape
    positions = step.positions
    device = step.ids.device
    diag = torch.arange(q, device=device)
    pad_rows = ~step.real
    new = step.see_new.clone()
    new[:, diag, diag] |= pad_rows
    has_past = call is not None and call.length > 0
    prefix_len = prefix.length

    def build(window: int | None, kept: int) -> torch.Tensor:
        parts = []
        if window is not None or not shared:
            visible = torch.ones(batch, q, kept, dtype=torch.bool, device=device)
            if window is not None:
                key_pos = torch.arange(prefix_len - kept, prefix_len, device=device)
                visible &= (positions[:, :, None] - key_pos[None, None]) < window
            parts.append(visible)
        if has_past:
            visible = step.see_past & call.real[:, None, :]
            if window is not None:
                visible = visible & ((positions[:, :, None] - call.positions[:, None, :]) < window)
            parts.append(visible)
        visible = new
        if window is not None:
            visible = new & ((positions[:, :, None] - positions[:, None, :]) < window)
            visible[:, diag, diag] |= pad_rows
        parts.append(visible)
        mask = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))[:, None]
        return mask if shared else _as_attention_mask(model, mask)

    kinds: dict[str, torch.Tensor] = {}
    layer_types = getattr(model.config, "layer_types", None)
    for i, state in enumerate(prefix.layers):
        kind = layer_types[i] if layer_types else ("sliding_attention" if state.sliding_window else "full_attention")
        if kind not in kinds:
            kinds[kind] = build(state.sliding_window, state.kept)
    if len(kinds) == 1:
        return next(iter(kinds.values()))
    return kinds


def _as_attention_mask(model, mask: torch.Tensor) -> torch.Tensor:
    if model.config._attn_implementation in ("sdpa", SHARED_SDPA):
        return mask
    if model.config._attn_implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    raise ValueError(f"sequence scoring needs sdpa or eager attention, not "
                     f"{model.config._attn_implementation!r}; load the model with attn_implementation='sdpa'")
