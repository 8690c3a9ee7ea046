"""Linear layers on weights laid out once for the CPU's GEMM (oneDNN), for fp32 inference.

torch's fp32 `F.linear` on a CPU hands the weight to the GEMM as it is stored, and the GEMM
re-lays it out into its own blocks on every call. oneDNN can do that once ("prepacking"):
on this model's shapes it measured 1.1-1.4x faster at 1,216 tokens and up to 1.9x at 19
(`benchmarks.peers --profile`). `prepack_linears(module)` switches every plain `nn.Linear`
under `module` to `PackedLinear`, whose forward runs on a packed copy of its weight. The
weight itself stays what it was, so state dicts, tied weights and every other reader
(the label scorers read the LM head's weight; it is not under the base model anyway) see
no change. Results equal `F.linear`'s within float rounding (a different summation order);
the switch happens only after a check of that on this machine.

The packed copy is an opaque oneDNN tensor: read-only and shared by threads, never pickled
or deep-copied (a copy re-packs on its first call), and re-packed if the weight tensor is
replaced. Anything else (autograd, another device or dtype) runs plain `F.linear`.

Siblings: the linears a model calls one after another on the *same* input tensor (an
attention's q/k/v projections, a gated MLP's gate and up projections) are one GEMM on
their concatenated weights, which at a few tokens per call (batch 1) is markedly faster
than three or two small ones. `fuse_siblings(base_model)` finds them by watching one
forward pass (which layers receive the very same tensor object), groups them, and keeps
the grouping only if the model's output is unchanged. The first member called computes
the whole group and leaves the other members' columns for their own calls, in a slot of
the calling thread keyed by that input tensor (identity and version): a member called on
any other tensor computes alone, so results never depend on the call order. Slots are
dropped when their last member takes its part, and when the base model's forward ends,
also when it raises.
"""

from __future__ import annotations

import itertools
import threading

import torch

__all__ = ["PackedLinear", "prepack_linears", "unpack_linears", "prepack_works", "fuse_siblings", "unfuse_siblings"]

_OPS = getattr(torch.ops, "mkldnn", None)
_REPACK_LOCK = threading.Lock()
_works: bool | None = None
_GROUP = "_beam_prefix_group"  # a member's (group, index), in its __dict__
# per thread: group -> (input, its version, the group's output, members yet to take theirs)
_SLOTS = threading.local()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def prepack_works() -> bool:
    """oneDNN's packed linear exists here and equals `F.linear` on a small fp32 check."""
    global _works
    if _works is None:
        _works = False
        if torch.backends.mkldnn.is_available() and hasattr(_OPS, "_linear_pointwise"):
            try:
                gen = torch.Generator().manual_seed(0)
                x, w, b = torch.randn(2, 5, 24, generator=gen), torch.randn(16, 24, generator=gen), torch.randn(16)
                with torch.inference_mode():
                    got = _packed_linear(x, _pack(w), b)
                _works = bool(torch.allclose(got, torch.nn.functional.linear(x, w, b), atol=1e-5))
            except Exception:  # a torch built without it, or another signature: stay plain
                _works = False
    return _works


class PackedLinear(torch.nn.Linear):
    """`nn.Linear` computing with a packed copy of its weight (fp32, CPU, no autograd)."""

    def _packed(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        held = self.__dict__.get("_beam_prefix_packed")
        if held is None or held[0] != key:
            with _REPACK_LOCK:
                held = self.__dict__.get("_beam_prefix_packed")
                if held is None or held[0] != key:
                    held = (key, _pack(self.weight))
                    self.__dict__["_beam_prefix_packed"] = held
        return held[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != torch.float32
                or w.dtype != torch.float32 or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return super().forward(x)
        grouped = self.__dict__.get(_GROUP)
        if grouped is not None:
            return grouped[0].output(grouped[1], x)
        return _packed_linear(x, self._packed(), self.bias)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_beam_prefix_packed", None)  # opaque: a copy packs its own on first use
        state.pop(_GROUP, None)  # and computes alone
        return state


class _Siblings:
    """`PackedLinear`s called on one input, computed as one GEMM: output ``[..., sum(out)]``,
    member i's columns ``bounds[i]``."""

    def __init__(self, members: list[PackedLinear]):
        self.members = members
        ends = list(itertools.accumulate(m.out_features for m in members))
        self.bounds = list(zip([0] + ends[:-1], ends))
        self._held = None

    def _key(self):
        return tuple((m.weight.data_ptr(), m.weight._version,
                      None if m.bias is None else (m.bias.data_ptr(), m.bias._version)) for m in self.members)

    def _fused(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        key, held = self._key(), self._held
        if held is None or held[0] != key:
            with _REPACK_LOCK:
                held = self._held
                if held is None or held[0] != key:
                    weight = torch.cat([m.weight.detach() for m in self.members])
                    bias = None
                    if any(m.bias is not None for m in self.members):  # zeros where a member has none
                        bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                                          for m in self.members])
                    held = self._held = (key, _pack(weight), bias)
        return held[1], held[2]

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for `x`: its columns of the group's output, computed now
        unless an earlier member's call computed it for this very tensor."""
        start, stop = self.bounds[index]
        slots = _thread_slots()
        slot = slots.get(self)
        version = _version(x)
        if slot is not None and slot[0] is x and slot[1] == version and index in slot[3]:
            slot[3].discard(index)
            if not slot[3]:
                del slots[self]
            return slot[2][..., start:stop]
        packed, bias = self._fused()
        out = _packed_linear(x, packed, bias)
        slots[self] = (x, version, out, set(range(len(self.members))) - {index})
        return out[..., start:stop]


def _version(x: torch.Tensor) -> int | None:
    """In-place writes to `x` so far; None for an inference tensor, which counts none (a
    model writing into the shared input between its siblings' calls fails the check of
    `fuse_siblings` instead)."""
    return None if x.is_inference() else x._version


def _thread_slots() -> dict:
    slots = getattr(_SLOTS, "slots", None)
    if slots is None:
        slots = _SLOTS.slots = {}
    return slots


def _drop_slots(module, args, output) -> None:
    """Forward hook (always called) of a model with siblings: nothing waits past its forward."""
    _thread_slots().clear()


def fuse_siblings(base_model: torch.nn.Module, vocab_size: int) -> int:
    """Group the `PackedLinear`s under `base_model` that its forward calls on the same input
    tensor (see the module docstring); returns how many groups. A grouping that changes the
    model's output beyond float rounding, or that its forward rejects, is undone (0)."""
    members = [m for m in base_model.modules() if type(m) is PackedLinear]
    if not members:
        return 0
    device = members[0].weight.device
    ids = torch.arange(1, 1 + min(6, max(1, vocab_size - 1)), device=device)[None]
    seen: dict[int, list[PackedLinear]] = {}
    inputs = []  # keeps each input alive, so that no id is reused during the pass

    def watch(module, args):
        if args:  # a call by keyword is never grouped
            inputs.append(args[0])
            seen.setdefault(id(args[0]), []).append(module)

    hooks = [m.register_forward_pre_hook(watch) for m in members]
    try:
        with torch.inference_mode():
            expected = base_model(input_ids=ids).last_hidden_state
    except Exception:  # a model that needs more than token ids: leave it ungrouped
        return 0
    finally:
        for h in hooks:
            h.remove()
    calls: dict[PackedLinear, int] = {}
    for group in seen.values():
        for m in group:
            calls[m] = calls.get(m, 0) + 1
    groups = [g for g in seen.values()
              if len(g) > 1 and len(set(g)) == len(g) and all(calls[m] == 1 for m in g)
              and len({(m.in_features, m.weight.dtype, m.weight.device) for m in g}) == 1]
    for group in groups:
        siblings = _Siblings(group)
        for i, m in enumerate(group):
            m.__dict__[_GROUP] = (siblings, i)
            m.__dict__.pop("_beam_prefix_packed", None)  # the group's copy serves it now
    if not groups:
        return 0
    try:
        with torch.inference_mode():
            same = torch.allclose(base_model(input_ids=ids).last_hidden_state, expected, atol=1e-4, rtol=1e-4)
    except Exception:  # a model that cannot take its projections as views of one output
        same = False
    finally:
        _thread_slots().clear()
    if not same:
        unfuse_siblings(base_model)
        return 0
    if _drop_slots not in [h for h in base_model._forward_hooks.values()]:
        base_model.register_forward_hook(_drop_slots, always_call=True)
    return len(groups)


def unfuse_siblings(module: torch.nn.Module) -> int:
    """Let every `PackedLinear` under `module` compute alone again; returns how many did not."""
    count = 0
    for sub in module.modules():
        if sub.__dict__.pop(_GROUP, None) is not None:
            count += 1
    return count


def prepack_linears(module: torch.nn.Module) -> int:
    """Switch each plain fp32 CPU `nn.Linear` under `module` to `PackedLinear` (packed
    now); returns how many. Nothing is switched where `prepack_works()` is false."""
    if not prepack_works():
        return 0
    count = 0
    for sub in module.modules():
        w = getattr(sub, "weight", None)
        if type(sub) is torch.nn.Linear and w is not None and w.device.type == "cpu" and w.dtype == torch.float32:
            sub.__class__ = PackedLinear
            sub._packed()
            count += 1
    return count


def unpack_linears(module: torch.nn.Module) -> int:
    """Switch `PackedLinear`s under `module` back to plain `nn.Linear` (e.g. before a tool
    that replaces layers by their exact type, such as dynamic quantization); returns how many."""
    count = 0
    unfuse_siblings(module)
    for sub in module.modules():
        if type(sub) is PackedLinear:
            sub.__dict__.pop("_beam_prefix_packed", None)
            sub.__class__ = torch.nn.Linear
            count += 1
    return count
