"""Why dynamic int8 disagreed with fp32, and whether a weight-only int8 mode could pay here.

    python -m benchmarks.quantization          # prints both tables (a minute on 2 cores)

1. Per linear layer of the embedded model, on its real inputs (the support task's prompt
   and 16 sample tickets): the relative error of int8 with one scale per activation tensor
   (what `torch.ao.quantization.quantize_dynamic` does) against int8 weights with one scale
   per output channel, and how far the input's largest channel stands above its median one.
2. torch's weight-only int8 kernel (`aten._weight_int8pack_mm`) against our fp32 prepacked
   linear and bf16 `F.linear`, on the model's layer shapes at 1,216 tokens (a batch of 64
   rows) and 19 (one row).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from benchmarks.data import TASKS, sample_tickets


def _per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().max() / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


def _per_channel(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(1, keepdim=True) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def layer_errors(threads: int = 2) -> list[tuple[str, float, float, float]]:
    from beam_prefix import PrefixClassifier, TaskSpec
    from beam_prefix.model.loading import load_model

    loaded = load_model("embedded", threads=threads, prepack=False)
    inputs: dict[str, torch.Tensor] = {}
    linears = {n: m for n, m in loaded.model.base_model.named_modules() if isinstance(m, torch.nn.Linear)}
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: inputs.__setitem__(n, inp[0].reshape(-1, inp[0].shape[-1])))
             for n, m in linears.items()]
    task = TaskSpec.from_yaml(os.path.join(TASKS, "support_tickets.yaml"))
    tickets = sample_tickets(16)
    PrefixClassifier(task=task, loaded=loaded, verify=False, batch_size=16).classify(tickets)
    for h in hooks:
        h.remove()
    rows = []
    with torch.inference_mode():
        for name, x in inputs.items():
            w = linears[name].weight
            ref = torch.nn.functional.linear(x, w)
            act = float((torch.nn.functional.linear(_per_tensor(x), w) - ref).norm() / ref.norm())
            wgt = float((torch.nn.functional.linear(x, _per_channel(w)) - ref).norm() / ref.norm())
            peak = x.abs().amax(0)
            rows.append((name, act, wgt, float(peak.max() / peak.median())))
    return sorted(rows, key=lambda r: -r[1])


def kernel_times(threads: int = 2) -> list[dict]:
    from beam_prefix.model.cpu_linear import _pack, _packed_linear

    torch.set_num_threads(threads)

    def best(fn, n=5):
        fn()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return min(times)

    out = []
    with torch.inference_mode():
        for tokens in (1216, 19):
            for n, k in ((576, 576), (192, 576), (1536, 576), (576, 1536)):
                x, w = torch.randn(tokens, k), torch.randn(n, k) * 0.05
                scale = w.abs().amax(1) / 127
                wq = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
                packed, xb, wb = _pack(w), x.bfloat16(), w.bfloat16()
                out.append({"tokens": tokens, "shape": f"{k}->{n}",
                            "fp32_prepacked_ms": best(lambda: _packed_linear(x, packed, None)),
                            "bf16_ms": best(lambda: torch.nn.functional.linear(xb, wb)),
                            "int8_weights_fp32_act_ms": best(lambda: torch.ops.aten._weight_int8pack_mm(x, wq, scale)),
                            "int8_weights_bf16_act_ms": best(
                                lambda: torch.ops.aten._weight_int8pack_mm(xb, wq, scale.bfloat16()))})
    return out


def main() -> None:
    rows = layer_errors()
    print("| layer (worst 8 of %d) | int8 activations, one scale per tensor | int8 weights, per channel "
          "| largest / median input channel |" % len(rows))
    print("| --- | --- | --- | --- |")
    for name, act, wgt, ratio in rows[:8]:
        print(f"| {name} | {act:.1%} | {wgt:.2%} | {ratio:.0f}x |")
    print(f"| median over all layers | {statistics.median(r[1] for r in rows):.1%} | "
          f"{statistics.median(r[2] for r in rows):.2%} | |")
    print()
    print("| tokens | layer | fp32 prepacked ms | bf16 ms | int8 weights, fp32 activations ms | "
          "int8 weights, bf16 activations ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in kernel_times():
        print(f"| {r['tokens']} | {r['shape']} | {r['fp32_prepacked_ms']:.3f} | {r['bf16_ms']:.3f} | "
              f"{r['int8_weights_fp32_act_ms']:.3f} | {r['int8_weights_bf16_act_ms']:.3f} |")


if __name__ == "__main__":
    main()
