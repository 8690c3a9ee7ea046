"""Half precision where it pays and float32 where it matters: the engine's ``bfloat16`` and
``float16``.

A model cast to bf16 whole keeps its residual stream, norms, attention and log-softmax in
8 bits of mantissa: on one H200 that gave the support task 88.3% label agreement with
float32, and on this project's CPU 80.2% (126 tickets, `benchmarks.precision`). The time, though, is in
the linear layers (GEMMs). `half_linears(base_model, dtype)` therefore switches only those
to `HalfLinear`: the weight stored in half precision, the input cast to it for the GEMM,
the output back in float32. Everything else stays float32: the embeddings, every norm, the
residual stream, attention over the prefix cache (whose keys and values are float32), the
hidden states a trained head reads, the LM head and the label log-softmax.

The engine's results then differ from float32 by the GEMMs' rounding, and cached results
differ from full re-encoding by the same rounding applied to different shapes (a GEMM's
blocking can depend on its row count): `TOLERANCE` holds the self-check's per-dtype
probability tolerance, measured (`benchmarks.precision`) and documented in docs/benchmarks.md.
A head's fingerprint carries `precision_name`, so a head fit in one precision is refused
in another (fit it in the precision it runs in).

`nn.Linear` and GPT-2's ``Conv1D`` (the same map, its weight stored transposed) are
switched; the output layer is not under the base model and stays float32.
"""

from __future__ import annotations

import torch

__all__ = ["HalfLinear", "half_linears", "compute_dtype", "precision_name", "dtype_of", "linears_precision", "TOLERANCE",
           "HALF_DTYPES", "native_bf16"]

HALF_DTYPES = (torch.bfloat16, torch.float16)
_MARK = "_beam_prefix_half"  # on the model: the half dtype its base model's linears compute in

# The start-up self-check's tolerance on a label probability, cached vs full re-encoding.
# float32: float rounding only (measured <= 1e-5). bf16 linears: the largest difference
# measured on the embedded model was 0.046 (support task, all 126 tickets, mean 0.010:
# `benchmarks.precision`), so 0.1, about twice it; a probe whose reference's top two labels
# are within it may swap them. float16 rounds 8x finer than bf16 and is not measured here
# (GPUs only): bf16's bound. A broken cache is still far outside: a row's probabilities
# then move by more than the spread between texts.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.1}


class HalfLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` ``[out, in]`` stored in `dtype` (bf16 or fp16): the input
    ``[..., in]`` is cast to `dtype` for the GEMM, the output ``[..., out]`` is float32, the
    bias (float32) added after. Stateless between calls: threads share it freely."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = torch.nn.Parameter(weight.detach().to(dtype).contiguous(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).float()
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"


def _as_half(module: torch.nn.Module, dtype: torch.dtype) -> HalfLinear | None:
    if isinstance(module, torch.nn.Linear):  # PackedLinear too: its weight is a plain fp32 weight
        return HalfLinear(module.weight, module.bias, dtype)
    if type(module).__name__ == "Conv1D" and getattr(module, "nf", None) is not None:  # GPT-2: weight [in, out]
        return HalfLinear(module.weight.t(), module.bias, dtype)
    return None


def half_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Switch every linear layer of `model`'s base model (`model.base_model`, so not the
    output layer) to a `HalfLinear` in `dtype`, the rest of `model` to float32; marks the
    model (`compute_dtype`). Returns how many layers were switched.

    Raises:
        ValueError: `dtype` is not bf16 or fp16, or the model has no linear layer to switch.
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"half precision is bfloat16 or float16, not {dtype}")
    model.float()
    count = 0
    for parent in list(model.base_model.modules()):
        for name, child in list(parent.named_children()):
            half = _as_half(child, dtype)
            if half is not None:
                setattr(parent, name, half.to(child.weight.device))
                count += 1
    if not count:
        raise ValueError(f"{type(model).__name__} has no linear layers to run in {dtype}")
    setattr(model, _MARK, dtype)
    return count


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The precision `model`'s GEMMs run in: the half dtype `half_linears` set, else the
    parameters' dtype."""
    marked = getattr(model, _MARK, None)
    return marked if marked is not None else next(model.parameters()).dtype


def precision_name(model: torch.nn.Module) -> str:
    """``float32``, or ``bfloat16-linears`` / ``float16-linears`` after `half_linears`:
    what a head's fingerprint records (a head fit on features of one is refused on another)."""
    marked = getattr(model, _MARK, None)
    return linears_precision(marked) if marked is not None else str(next(model.parameters()).dtype)[len("torch."):]


def dtype_of(precision: str) -> str | None:
    """The `load_model` dtype name that computes in `precision` (`precision_name`), or None
    for one it never gives (a model cast whole to a half dtype by other means)."""
    if precision == "float32":
        return precision
    name = precision.removesuffix("-linears")
    return name if name != precision and name in ("bfloat16", "float16") else None


def linears_precision(dtype: torch.dtype) -> str:
    """`precision_name` of a model whose linears compute in `dtype` (`half_linears` for a half
    dtype, else all of it in `dtype`): what `load_model(dtype=...)` gives."""
    name = str(dtype)[len("torch."):]
    return f"{name}-linears" if dtype in HALF_DTYPES else name


def native_bf16() -> bool:
    """Whether this machine's CPU computes bf16 natively (AVX512-BF16 or AMX): where bf16
    GEMMs cost a fraction of float32's. Elsewhere torch emulates them, slower than float32."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
