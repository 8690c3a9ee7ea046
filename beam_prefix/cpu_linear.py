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
"""

from __future__ import annotations

import threading

import torch

__all__ = ["PackedLinear", "prepack_linears", "unpack_linears", "prepack_works"]

_OPS = getattr(torch.ops, "mkldnn", None)
_REPACK_LOCK = threading.Lock()
_works: bool | None = None


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
        return _packed_linear(x, self._packed(), self.bias)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_beam_prefix_packed", None)  # opaque: a copy packs its own on first use
        return state


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
    for sub in module.modules():
        if type(sub) is PackedLinear:
            sub.__dict__.pop("_beam_prefix_packed", None)
            sub.__class__ = torch.nn.Linear
            count += 1
    return count
