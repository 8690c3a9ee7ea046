"""Attention over a prefix kept once, at batch 1, shared by every row and every thread.

Reusing a prefix through a `DynamicCache` seats each layer on the prefix keys and values
expanded to the batch size; the forward pass then `torch.cat`s that view with the batch's
new tokens, materialising batch x prefix keys and values in every layer, for every batch,
in every thread (and sdpa repeats them once more per query head under GQA). That copy,
not the arithmetic, dominated a cached batch, and it made memory grow with threads.

Here the model runs only the batch's new tokens, with no cache object at all. A registered
attention function (`SHARED_SDPA`, which is plain sdpa on every other call) finds the
layer's prefix keys and values in a keyword argument of the forward pass and computes the
softmax over ``[prefix | new]`` keys in two parts:

* prefix part: the queries of all rows folded into one matrix per key/value head,
  ``[1, kv_heads, group * T, head_dim]`` against the batch-1 prefix
  ``[1, kv_heads, kept, head_dim]``, never copied; on CPU through torch's blocked flash
  kernel (which returns the part's logsumexp), on other devices through plain matmuls;
* new part: each row's queries against its own new keys (and the call's earlier tokens).

Each part yields its softmax-weighted values and logsumexp; weighting them by their share
of the total mass gives the same softmax as over the concatenation (fp32 results equal
sdpa's within rounding). A batch of one row that sees the whole prefix skips the split:
its one copy of the prefix is cheaper than the extra kernels (plain sdpa over the
concatenation). Nothing of a call outlives it: no working cache grows or is cropped.

Masks (boolean, True = attend) are ``[rows, 1, q, q]`` when the whole prefix is visible to
every query, or ``[rows, 1, q, kept + q]`` (prefix columns first) when it is not, e.g.
on a sliding-window layer.

A batch runs *packed* (`Packing`): its rows' real tokens concatenated into one sequence,
``[1, T]``, with no padding, so the linear layers (most of the work) and the prefix part
compute nothing for pad columns, however unequal the rows are. Only the small new part is
laid out padded, ``[rows, kv_heads, group * q, q]``, so that the padded masks above (tree
masks and sliding windows included) apply unchanged.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import torch

__all__ = ["SHARED_SDPA", "PREFIX_KWARG", "PACKING_KWARG", "CALL_KWARG", "Packing", "enable_shared_prefix",
           "shared_prefix_attention", "prefix_kwargs"]

SHARED_SDPA = "beam_prefix_sdpa"
# keyword argument of the model forward that carries the per-layer prefix states
PREFIX_KWARG = "beam_prefix_layers"
# keyword argument that marks a packed batch and carries its `Packing`
PACKING_KWARG = "beam_prefix_packing"
# keyword argument carrying the call's own earlier tokens (`engine.CallState`): read, then extended
CALL_KWARG = "beam_prefix_call"
# score elements per chunk of rows (x4 bytes): bounds memory when prefix and queries are long
_CHUNK_ELEMENTS = 1 << 23

_REGISTER_LOCK = threading.Lock()
_registered = False


def _register() -> None:
    global _registered
    with _REGISTER_LOCK:
        if _registered:
            return
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import sdpa_mask

        def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            layers = kwargs.pop(PREFIX_KWARG, None)
            if layers is None:  # any other call: exactly sdpa
                return sdpa_attention_forward(module, query, key, value, attention_mask,
                                              scaling=scaling, dropout=dropout, **kwargs)
            if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
                raise NotImplementedError("shared-prefix attention does not support logit softcapping or sinks")
            packing = kwargs.pop(PACKING_KWARG)  # shared-prefix batches always run packed
            call = kwargs.pop(CALL_KWARG, None)
            state = layers[module.layer_idx]
            past = call.past(module.layer_idx) if call is not None else None
            out = shared_prefix_attention(query, key, value, attention_mask, state.keys, state.values,
                                          scaling if scaling is not None else query.shape[-1] ** -0.5,
                                          packing=packing, past=past)
            if call is not None:  # later steps of this call attend to these tokens too
                call.record(module.layer_idx, packing.unpack(key.transpose(1, 2)).transpose(1, 2),
                            packing.unpack(value.transpose(1, 2)).transpose(1, 2))
            return out, None

        AttentionInterface.register(SHARED_SDPA, attention)
        AttentionMaskInterface.register(SHARED_SDPA, sdpa_mask)
        _registered = True


def enable_shared_prefix(model) -> bool:
    """Switch `model` from sdpa to `SHARED_SDPA` (identical unless a call passes prefix
    states); returns whether the model now uses it. Models on other attention
    implementations, or that do not dispatch through `AttentionInterface`, are left alone."""
    current = model.config._attn_implementation
    if current == SHARED_SDPA:
        return True
    if current != "sdpa" or not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return False
    _register()
    model.set_attn_implementation(SHARED_SDPA)
    return model.config._attn_implementation == SHARED_SDPA


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where the tokens of a packed batch sit in its padded layout.

    Each row's tokens are contiguous in the packed sequence, rows in order.

    Attributes:
        index: ``[T]`` long, ``row * width + column`` of each packed token.
        offsets: ``[B + 1]`` long, first packed token of each row (``offsets[B] == T``).
        width: ``Q``, columns per row in the padded layout (the masks' query length).
    """

    index: torch.Tensor
    offsets: torch.Tensor
    width: int

    @classmethod
    def of_real(cls, real: torch.Tensor) -> "Packing":
        """From the padded layout's ``[B, Q]`` bool of real tokens, with one host
        synchronisation for the whole batch (the packed length), not one per row."""
        width = int(real.shape[1])
        index = real.reshape(-1).nonzero().squeeze(1)
        offsets = torch.cat([real.new_zeros(1, dtype=torch.long), real.sum(1).cumsum(0)])
        return cls(index=index, offsets=offsets, width=width)

    @classmethod
    def dense_of(cls, rows: int, width: int, device: torch.device | str) -> "Packing":
        """Every column of a ``[rows, width]`` layout packed, pad columns too (`dense`:
        packing is a reshape). Made from shapes alone, with no host synchronisation, so a
        pass over a fixed shape can be captured as a CUDA graph (`suffix_graphs`)."""
        return cls(index=torch.arange(rows * width, device=device),
                   offsets=torch.arange(rows + 1, device=device) * width, width=width)

    @property
    def rows(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def dense(self) -> bool:
        """No pad column (every row as wide as the layout, e.g. one row): packing is a reshape."""
        return int(self.index.shape[0]) == self.rows * self.width

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """``[B, Q, ...]`` -> ``[1, T, ...]``."""
        flat = padded.reshape(-1, *padded.shape[2:])
        return (flat if self.dense else flat[self.index])[None]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[1, T, ...]`` -> ``[B, Q, ...]``, zeros at the pad columns."""
        if self.dense:
            return packed.reshape(self.rows, self.width, *packed.shape[2:])
        flat = packed.new_zeros(self.rows * self.width, *packed.shape[2:])
        flat[self.index] = packed[0]
        return flat.view(self.rows, self.width, *packed.shape[2:])

    def slice(self, start: int, stop: int) -> tuple[int, int, "Packing"]:
        """Rows ``[start, stop)``: their packed token range and their own `Packing` (a dense
        packing's range follows from its shape: no host synchronisation)."""
        if self.dense:
            first, last = start * self.width, stop * self.width
            return first, last, Packing.dense_of(stop - start, self.width, self.index.device)
        first, last = int(self.offsets[start]), int(self.offsets[stop])
        part = Packing(index=self.index[first:last] - start * self.width,
                       offsets=self.offsets[start:stop + 1] - first, width=self.width)
        return first, last, part


def shared_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            mask: torch.Tensor, prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
                            scaling: float, packing: Packing,
                            past: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Softmax attention over a batch-1 prefix, then each row's earlier tokens of this call
    (if any), then each row's own new tokens, for a packed batch.

    Args:
        query: ``[1, H, T, D]``, the batch's real tokens packed (`packing`).
        key, value: the new tokens, ``[1, KV, T, D]`` (H a multiple of KV).
        mask: boolean ``[B, 1, Q, N + Q]`` (prefix fully visible) or ``[B, 1, Q, P + N + Q]``,
            in the padded layout (N: the earlier tokens in `past`, else 0).
        prefix_keys, prefix_values: ``[1, KV, P, D]``.
        scaling: the softmax scale.
        packing: where the packed tokens sit in the padded layout.
        past: keys and values of the rows' earlier tokens, ``[B, KV, N, D]`` each, padded.
    Returns:
        ``[1, T, H, D]`` (the layout transformers' attention functions return).
    """
    if packing.rows == 1 and packing.dense and past is None and mask.shape[-1] == packing.width:
        return _one_row(query, key, value, mask, prefix_keys, prefix_values, scaling)
    heads = query.shape[1]
    batch, q = packing.rows, packing.width
    kept = prefix_keys.shape[-2]
    n_past = past[0].shape[-2] if past is not None else 0
    flash = mask.shape[-1] == n_past + q and query.device.type == "cpu" and _flash_works()
    per_row = heads * q * (n_past + q if flash else kept + n_past + q)
    step = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    if step >= batch:  # one chunk: the whole batch, with no host sync for its token range
        return _attend_packed(query, key, value, mask, prefix_keys, prefix_values, scaling, packing, past)
    parts = []
    for i in range(0, batch, step):
        first, last, part = packing.slice(i, min(i + step, batch))
        if first == last:  # rows with no new token in this pass
            continue
        rows = None if past is None else (past[0][i:i + step], past[1][i:i + step])
        parts.append(_attend_packed(query[:, :, first:last], key[:, :, first:last], value[:, :, first:last],
                                    mask[i:i + step], prefix_keys, prefix_values, scaling, part, rows))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _one_row(query, key, value, mask, prefix_keys, prefix_values, scaling):
    """One row that sees the whole prefix and has no earlier tokens: plain sdpa over
    ``[prefix | new]`` keys (GQA in the kernel). At batch 1 the concatenation copies one
    prefix's keys and values, which costs less than the two-part softmax's extra kernels
    (measured about 2x faster per layer on the embedded model at 19 tokens)."""
    keys = torch.cat([prefix_keys, key], dim=2)
    values = torch.cat([prefix_values, value], dim=2)
    visible = torch.cat([mask.new_ones(*mask.shape[:-1], prefix_keys.shape[-2]), mask], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scaling,
                                                           enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(1, 2)


def _attend_packed(query, key, value, mask, prefix_keys, prefix_values, scaling, packing: Packing, past):
    _, heads, t, dim = query.shape
    kv = key.shape[1]
    group = heads // kv
    kept = prefix_keys.shape[-2]
    batch, width = packing.rows, packing.width
    n_past = past[0].shape[-2] if past is not None else 0
    qs = query * scaling
    # prefix part: the packed queries of a kv head are already one matrix, [1, KV, group*T, D]
    folded = qs.reshape(1, kv, group * t, dim)
    seen = packing.pack(mask[:, 0, :, :kept])[0] if mask.shape[-1] == kept + n_past + width else None
    out_pre, lse_pre = _prefix_part(folded, prefix_keys, prefix_values, seen, group)
    out_pre = out_pre.view(kv, group, t, dim).permute(2, 0, 1, 3)  # [T, KV, group, D]
    lse_pre = lse_pre.view(kv, group, t).permute(2, 0, 1)
    # the rows' own part, padded so the per-row masks apply: [B, KV, group*Q, N + Q], where
    # N are the call's earlier tokens of the row; pad q/k/v are zeros
    qp = packing.unpack(qs.transpose(1, 2)).view(batch, width, kv, group, dim).permute(0, 2, 3, 1, 4)
    kp = packing.unpack(key.transpose(1, 2)).transpose(1, 2)  # [B, KV, Q, D]
    vp = packing.unpack(value.transpose(1, 2)).transpose(1, 2)
    if past is not None:
        kp, vp = torch.cat([past[0], kp], dim=2), torch.cat([past[1], vp], dim=2)
    cols = n_past + width
    scores = torch.matmul(qp, kp[:, :, None].transpose(-1, -2)).float()  # [B, KV, group, Q, N + Q]
    scores.masked_fill_(~mask[:, :, None, :, -cols:], float("-inf"))
    out_new, lse_new = _softmax_part(scores.view(batch, kv, group * width, cols), vp)
    out_new = packing.pack(out_new.view(batch, kv, group, width, dim).permute(0, 3, 1, 2, 4))[0]
    lse_new = packing.pack(lse_new.view(batch, kv, group, width).permute(0, 3, 1, 2))[0]
    return _merge((out_pre, lse_pre), (out_new, lse_new)).to(query.dtype).reshape(1, t, heads, dim)


def _prefix_part(folded, prefix_keys, prefix_values, seen, group):
    """Packed queries ``[1, KV, group * T, D]`` against the batch-1 prefix ``[1, KV, P, D]``.

    `seen` (``[T, P]`` bool, or None when every query sees the whole prefix) comes from a
    window: the columns every query sees go through the flash kernel as one block; only
    the leading *edge* columns that some query cannot see are scored with a mask. A
    sliding-window layer thus never materialises the ``[T, P]`` score matrix, however long
    the batch."""
    kept = prefix_keys.shape[-2]
    rows = folded.shape[2]
    edge = 0
    if seen is not None:
        hidden_somewhere = ~seen.all(0)  # [P]
        if bool(hidden_somewhere.any()):
            edge = int(hidden_somewhere.nonzero().max()) + 1
    parts = []
    if edge < kept:  # columns every query sees: no mask
        keys, values = prefix_keys[:, :, edge:], prefix_values[:, :, edge:]
        if folded.device.type == "cpu" and _flash_works():
            if edge:
                keys, values = keys.contiguous(), values.contiguous()
            parts.append(_FLASH_OP(folded, keys, values, scale=1.0)[:2])
        else:
            parts.append(_softmax_part(torch.matmul(folded, keys.transpose(-1, -2)).float(), values))
    if edge:  # the few columns hidden from some queries
        scores = torch.matmul(folded, prefix_keys[:, :, :edge].transpose(-1, -2)).float()
        t = rows // group
        hidden = ~seen[:, :edge].expand(group, t, edge).reshape(1, 1, rows, edge)
        parts.append(_softmax_part(scores.masked_fill_(hidden, float("-inf")), prefix_values[:, :, :edge]))
    return parts[0] if len(parts) == 1 else _merge_lse(parts)


def _merge(*parts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One softmax over several parts of the keys, each given as ``(output, logsumexp)``."""
    return _merge_lse(parts)[0]


def _merge_lse(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """Each part's output weighted by its share of the total mass (fp32); returns the merged
    output and the total logsumexp. A query that sees nothing in any part gets output 0
    (not NaN) and logsumexp -inf, so it still weighs nothing in a later merge."""
    lse = torch.logsumexp(torch.stack([p[1].float() for p in parts]), dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = sum(p[0].float() * torch.exp(p[1].float() - safe)[..., None] for p in parts)
    return out, lse


def _softmax_part(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to one part of the keys: ``(softmax(scores) @ values, logsumexp)``.
    A query with no visible key here gets output 0 and logsumexp -inf (weight 0 when merged)."""
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp_(scores.sub_(top))
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights.to(values.dtype), values).float() / total.clamp_min(torch.finfo(total.dtype).tiny)
    return out, (top + total.log()).squeeze(-1)


# torch's CPU flash-attention kernel, which (unlike the public sdpa) also returns the
# logsumexp needed to merge the prefix part with the new part. It is an internal op, so
# it is used only after a numerical check against the plain computation passes.
_FLASH_OP = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None)
_flash_ok: bool | None = None


def _flash_works() -> bool:
    global _flash_ok
    if _flash_ok is None:
        _flash_ok = False
        if _FLASH_OP is not None:
            try:
                gen = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (5, 7, 7))
                out, lse = _FLASH_OP(q, k, v, scale=0.5)
                ref_out, ref_lse = _softmax_part(torch.matmul(q, k.transpose(-1, -2)) * 0.5, v)
                _flash_ok = (out.shape == ref_out.shape and lse.shape == ref_lse.shape
                             and torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5))
            except Exception:  # a torch without it, or another signature: the plain path
                _flash_ok = False
    return _flash_ok


def prefix_kwargs(layers: Sequence, packing: Packing | None = None, call=None) -> dict:
    """The keyword arguments that route a forward pass's attention through the prefix
    (with `packing`, mark its ``[1, T]`` input as that packed batch; with `call`, an
    `engine.CallState`, let it attend to the call's earlier tokens and record its own)."""
    kwargs = {PREFIX_KWARG: layers}
    if packing is not None:
        kwargs[PACKING_KWARG] = packing
    if call is not None:
        kwargs[CALL_KWARG] = call
    return kwargs
