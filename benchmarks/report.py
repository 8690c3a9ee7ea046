"""Rendering of `benchmarks.speedup`'s report: Markdown table, JSON and the scaling PNG."""

from __future__ import annotations

import json
import os

__all__ = ["write"]


def write(report: dict, out_dir: str) -> str:
    """Write speedup.json, speedup.md and (with scaling) prefix_scaling.png; returns the Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "speedup.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    if report.get("scaling"):
        _plot_scaling(report["scaling"], os.path.join(out_dir, "prefix_scaling.png"))
    markdown = _markdown(report)
    with open(os.path.join(out_dir, "speedup.md"), "w", encoding="utf-8") as f:
        f.write(markdown + "\n")
    return markdown


def _plot_scaling(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["prefix_tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(x, [p["a_ms_per_row"] for p in points], "o-", label="A full re-encode")
    ax.plot(x, [p["c_ms_per_row"] for p in points], "s-", label="C classify (prefix cached, batch 16)")
    ax.set_xlabel("static prefix tokens")
    ax.set_ylabel("ms per row")
    ax.set_yscale("log")
    ax.set_title("Per-row time as the static prefix grows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _verdict(mode: dict) -> str:
    if mode["kept"]:
        return "yes"
    return "no (slower here)" if not mode["faster_than_fp32"] else "no (labels differ from A)"


def _markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']}; torch {report['torch']}, {report['torch_threads']} threads; "
             f"model {report['model']} ({report['dtype']}); one run, {report['date']}.", ""]
    for name, w in report["workloads"].items():
        lines += [f"**{name}**: {w['rows']} rows (A, B and C with the expanded cache on the first {w['a_rows']}), "
                  f"prefix {w['prefix_tokens']} tokens, "
                  f"{w['scoring']} scoring" + (f", label trie {w['label_tokens']} tokens" if w["label_tokens"] else ""),
                  "", "| contender | batch | ms/row | speedup vs A | labels = A |", "| --- | --- | --- | --- | --- |"]
        for c in w["contenders"]:
            batch = f"{c['batch']} (Beam batches of {c['beam_batch']})" if c.get("beam_batch") else c["batch"]
            lines.append(f"| {c['name']} | {batch} | {c['ms_per_row']:.1f} | {c['speedup_vs_a']:.1f}x | "
                         f"{c['agreement']:.1%} |")
        one = w.get("batch_one")
        if one:
            lines += ["", f"Batch 1 ({one['rows']} rows, interleaved rounds, best of each): C "
                          f"{one['c_ms_per_row']:.1f} ms/row, B {one['b_ms_per_row']:.1f} ms/row, C {one['c_over_b']:.2f}x "
                          f"faster; the matmul floor of one row ({one['tokens_per_row']:.0f} tokens at "
                          f"{one['matmul_gflops']:.0f} GFLOP/s) is {one['floor_ms_per_row']:.1f} ms/row."]
        f = w["floor"]
        lines += ["", f"FLOP floor: 2 x {f['non_embedding_params'] / 1e6:.1f}M params x "
                      f"{f['dynamic_tokens_per_row']:.1f} tokens/row at {f['matmul_gflops']:.1f} GFLOP/s (measured) = "
                      f"{f['floor_ms_per_row']:.1f} ms/row; C (batch {w['best_c']['batch']}) runs at "
                      f"{f['c_percent_of_floor']:.0f}% of the floor. Counting also attention and the output "
                      f"head ({f['other_gflop_per_row']:.1f} GFLOP/row more): floor "
                      f"{f['floor_with_attention_ms_per_row']:.1f} ms/row, C at "
                      f"{f['c_percent_of_floor_with_attention']:.0f}%. C/B {w['c_over_b']:.1f}x"
                  + (f"; D/C throughput {w['d_over_c_throughput']:.2f}." if "d_over_c_throughput" in w else "."), ""]
        if w.get("rounds"):
            lines += [f"Interleaved rounds at batch {w['best_c']['batch']} (ms/row per round; the tables "
                      f"report each contender's best): "
                      + "; ".join(f"{k} {', '.join(f'{v:.1f}' for v in vals)}" for k, vals in w["rounds"].items()), ""]
        if w.get("pruned_vs_exhaustive"):
            x = w["pruned_vs_exhaustive"]
            lines += [f"Pruned vs exhaustive label search: {x['speedup']:.2f}x faster; label tokens per row "
                      f"{x['pruned_label_tokens_per_row']:.1f} vs {x['exhaustive_label_tokens_per_row']} (suffix "
                      f"{x['suffix_tokens_per_row']:.1f}); labels agree on {x['label_agreement']:.1%} of rows; "
                      f"max probability difference {x['max_prob_diff']:.1e}.", ""]
    if report.get("sliding"):
        s = report["sliding"]
        lines += [f"**Sliding-window layers** ({s['model']}; Banking77 task, prefix {s['prefix_tokens']} tokens, "
                  f"exhaustive label search, {s['rows']} rows; max probability difference against full "
                  f"re-encoding: shared {s['shared_max_prob_diff_vs_full']:.1e}, expanded "
                  f"{s['expanded_max_prob_diff_vs_full']:.1e}):", "",
                  "| engine | batch | ms/row |", "| --- | --- | --- |"]
        lines += [f"| {r['engine']} | {r['batch']} | {r['ms_per_row']:.1f} |" for r in s["runs"]]
        lines.append("")
    if report.get("scaling"):
        lines += ["**Prefix-length scaling** (support task, examples added):", "",
                  "| prefix tokens | A ms/row | C ms/row | A/C |", "| --- | --- | --- | --- |"]
        lines += [f"| {p['prefix_tokens']} | {p['a_ms_per_row']:.1f} | {p['c_ms_per_row']:.1f} | "
                  f"{p['a_ms_per_row'] / p['c_ms_per_row']:.1f}x |" for p in report["scaling"]]
        lines.append("")
    if report.get("rss"):
        r = report["rss"]
        lines += [f"**Memory**: peak RSS of a ClassifyText worker: {r['rss_mb_1_thread']:.0f} MB with 1 thread, "
                  f"{r['rss_mb_4_threads']:.0f} MB with 4 threads ({r['ratio']:.2f}x).", ""]
    if report.get("modes"):
        lines += ["**Optional modes** (C at the best fp32 batch, on the rows A ran):", "",
                  "| mode | workload | ms/row | fp32 ms/row | labels = A | kept |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {m['mode']} | {m['workload']} | {m['ms_per_row']:.1f} | {m['fp32_ms_per_row']:.1f} | "
                  f"{m['agreement_with_a']:.1%} | {_verdict(m)} |"
                  for m in report["modes"]]
        lines.append("")
    return "\n".join(lines)


