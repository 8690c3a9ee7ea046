"""The prefix key/value cache: computed once, shared read-only, reused through working caches.

`PrefixCache` runs the static prefix through the model once and keeps each layer's keys
and values (``[1, kv_heads, prefix_len_l, head_dim]``; a sliding-window layer keeps only
its last ``window - 1`` positions). Its tensors are never mutated after construction, so
any number of threads may share it (the CUDA graphs it may keep are behind a lock).

Rows reach the prefix in one of two ways. Shared-prefix attention (`beam_prefix.model.attention`)
reads these tensors directly and needs nothing else. The expanded engine, for any other
attention implementation, uses a `WorkingCache`: the mutable part, one per caller (per
classifier instance, per DoFn instance), a `DynamicCache` whose layers are seated on the
prefix tensors expanded to the batch size (a view; the cache update's `torch.cat` then
copies it). A forward pass appends the batch's suffix tokens; `use()` crops them off
again afterwards, also when the forward raises, so between calls the working cache
always holds exactly the prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from beam_prefix.model.suffix_graphs import SuffixGraphs, check_suffix_pass_name

__all__ = ["PrefixCache", "WorkingCache", "LayerState", "new_cache"]

_LOGGER = logging.getLogger(__name__)


def new_cache(config, device: torch.device | str) -> DynamicCache:
    """A `DynamicCache` for `config` whose own tensors live on `device` (transformers makes
    some, e.g. a sliding layer's window, on torch's default device)."""
    with torch.device(device):
        return DynamicCache(config=config)


@dataclasses.dataclass(frozen=True)
class LayerState:
    """One layer's cached prefix.

    Attributes:
        keys, values: ``[1, kv_heads, kept, head_dim]``; ``kept`` is the prefix length, or
            ``min(prefix_len, window - 1)`` for a sliding-window layer.
        sliding_window: the layer's window, or None for full attention.
    """

    keys: torch.Tensor
    values: torch.Tensor
    sliding_window: int | None

    @property
    def kept(self) -> int:
        return self.keys.shape[-2]


class PrefixCache:
    """Keys and values of the static prefix, computed once by one forward pass.

    Args:
        model: a causal LM (`...ForCausalLM`); only its base model runs.
        prefix_ids: the prefix token ids.
        suffix_pass: how shared-prefix attention runs a batch's one-pass steps: ``packed``
            (default: the rows' real tokens only), ``buckets`` (padded to fixed shapes) or
            ``graphs`` (fixed shapes replayed as CUDA graphs; CUDA only). The latter two keep
            a `suffix_graphs.SuffixGraphs` in `graphs`: the one part of a prefix that
            changes after construction (graphs recorded on first use), behind its own lock.
    """

    def __init__(self, model, prefix_ids: Sequence[int], *, suffix_pass: str = "packed"):
        if not prefix_ids:
            raise ValueError("the prefix is empty: there is nothing to cache")
        check_suffix_pass_name(suffix_pass)
        self.model = model
        self.config = model.config
        self.length = len(prefix_ids)
        self.device = device = next(model.parameters()).device
        # made first: graphs on a model off CUDA are refused before the prefix's forward runs
        self.graphs = None if suffix_pass == "packed" else SuffixGraphs(device, capture=suffix_pass == "graphs")
        cache = new_cache(self.config, device)
        ids = torch.tensor([list(prefix_ids)], dtype=torch.long, device=device)
        with torch.inference_mode():
            model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids),
                             position_ids=torch.arange(self.length, device=device)[None],
                             cache=cache, use_cache=True)
        layers = []
        for layer in cache.layers:
            window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            if layer.keys is None:
                raise RuntimeError(f"{type(layer).__name__} holds no keys after the prefix pass; "
                                   "this cache layout is not supported")
            layers.append(LayerState(layer.keys.detach().clone(), layer.values.detach().clone(), window))
        self.layers: tuple[LayerState, ...] = tuple(layers)
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        for i, state in enumerate(self.layers):
            expected = self.length if state.sliding_window is None else min(self.length, state.sliding_window - 1)
            if state.kept != expected:
                raise RuntimeError(f"layer {i} cached {state.kept} prefix positions, expected {expected}")

    @property
    def nbytes(self) -> int:
        return sum(s.keys.numel() * s.keys.element_size() * 2 for s in self.layers)

    def working_cache(self) -> "WorkingCache":
        return WorkingCache(self)


class WorkingCache:
    """A caller's own cache on top of a shared `PrefixCache`. Not thread-safe: one per thread."""

    def __init__(self, prefix: PrefixCache):
        self.prefix = prefix
        self.cache: DynamicCache | None = None
        self.batch_size = 0
        self.plain = False
        self.rewinds = 0
        self._seat(1)

    def _seat(self, batch_size: int, plain: bool = False) -> None:
        cache = new_cache(self.prefix.config, self.prefix.device)
        if len(cache.layers) != len(self.prefix.layers):
            raise RuntimeError(f"cache has {len(cache.layers)} layers, prefix has {len(self.prefix.layers)}")
        for i, state in enumerate(self.prefix.layers):
            if plain:  # keeps every appended token; the masks apply the windows
                cache.layers[i] = DynamicLayer()
            layer = cache.layers[i]
            keys = state.keys.expand(batch_size, -1, -1, -1)
            values = state.values.expand(batch_size, -1, -1, -1)
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if state.sliding_window is not None and not plain:
                layer.cumulative_length = self.prefix.length
                # keep the full states until crop, so the window can roll back to the prefix
                layer.activate_past_recording()
        self.cache, self.batch_size, self.plain = cache, batch_size, plain

    def _extra(self) -> int:
        """Tokens appended after the prefix (the same count in every layer)."""
        layer = self.cache.layers[0]
        return 0 if layer.keys is None else layer.keys.shape[-2] - self.prefix.layers[0].kept

    def length(self) -> int:
        """Tokens the working cache currently represents (the prefix length between calls)."""
        return self.prefix.length + self._extra() if self.cache is not None else 0

    @contextlib.contextmanager
    def use(self, batch_size: int, *, plain: bool = False) -> Iterator[DynamicCache]:
        """Yield the cache seated for `batch_size` rows; crop back to the prefix on exit.

        `plain`: every layer a plain `DynamicLayer`, which keeps all tokens appended during
        the call (several forward passes); a window then lives only in the 4-D masks.
        Sliding-window cache layers would return only their last ``window - 1`` columns by
        *layout*, which in a padded multi-step layout is not the same as by position.
        """
        if self.length() != self.prefix.length:  # a crop failed earlier: start clean
            self._seat(batch_size, plain)
        elif batch_size != self.batch_size or plain != self.plain:
            self._seat(batch_size, plain)
        try:
            yield self.cache
        finally:
            self.rewind()

    def rewind(self) -> None:
        """Crop everything after the prefix (transformers 5: `crop` takes a negative count)."""
        try:
            extra = self._extra()
            if extra > 0:
                self.cache.crop(-extra)
            self.rewinds += 1
            ok = self._at_prefix()
        except Exception:  # never leave a half-cropped cache behind
            _LOGGER.exception("cropping the working cache failed; re-seating it on the prefix")
            ok = False
        if not ok:
            self._seat(self.batch_size or 1, self.plain)

    def _at_prefix(self) -> bool:
        for layer, state in zip(self.cache.layers, self.prefix.layers):
            if layer.keys is None or layer.keys.shape[-2] != state.kept:
                return False
            if getattr(layer, "is_sliding", False) and layer.cumulative_length != self.prefix.length:
                return False
        return True
