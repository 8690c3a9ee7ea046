"""Figures the pages quote in prose are their results files' (#63), as the tables are
(`test_docs_tables`): each entry below is a sentence fragment a page must contain, with its
numbers formatted from the named results file. A rerun that changes a figure fails this
test until the page says the new one."""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"
ACCURACY = {"default": "ours, default fit: plain `pipelines.fit`, features chosen by folds",
            "bf16": "ours, default fit, bfloat16: `pipelines.fit --dtype bfloat16`, features chosen by folds"}


def _results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def _candidate(summary: dict, layers: list[int]) -> dict:
    return next(c for c in summary["candidates"] if c["layers"] == layers)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _bf16_and_layers(d: dict) -> tuple:
    """The README's paragraph on what precision and the layer choice each buy."""
    f32, bf16 = d["ours_default_summary"], d["ours_default_bf16_summary"]
    best = lambda s: max(c["fold_accuracy"] for c in s["candidates"])  # noqa: E731
    gap = lambda s: f"{100 * (best(s) - _candidate(s, [1])['fold_accuracy']):.2f}"  # noqa: E731
    ms = lambda s, layer: f"{_candidate(s, [layer])['ms_per_row']:.1f}"  # noqa: E731
    return (f"best fold accuracy ({gap(bf16)} below) and took it; the float32 fit found it just outside "
            f"({gap(f32)})",
            f"(layer 6: {ms(bf16, 6)} against {ms(f32, 6)} ms/row; layer 1: {ms(bf16, 1)} against {ms(f32, 1)})")


def _bf16_heads(d: dict) -> tuple:
    a = d["accuracy"]
    return (f"{_pct(a[ACCURACY['bf16']]['full train'])} on the whole split and "
            f"{_pct(a[ACCURACY['bf16']]['10 rows per intent'])} at 10 rows per intent, against "
            f"{_pct(a[ACCURACY['default']]['full train'])} and {_pct(a[ACCURACY['default']]['10 rows per intent'])}",)


def _tuning_cost(d: dict) -> tuple:
    tuned = d["ours_default_tuned_summary_few"]
    rows = d["few"] - tuned["validation"]["rows"]
    return (f"{rows} of the {d['few']} rows at 10 per intent (the rest held out) x {tuned['epochs']} epochs took "
            f"{tuned['tune_s']:.0f} s",)


def _tuning_cost_every_contender(d: dict) -> tuple:
    return (f"one epoch, took {d['ours_early_tuned_record']['tune_s']:,.0f} s",
            f"tuned the 770 rows in {d['ours_early_tuned_record_few']['tune_s']:.0f} s")


def _default_costs(d: dict) -> tuple:
    best = d["workloads"]["support"]["best_c"]
    return (f"{best['ms_per_row']:.1f} ms/row at batch {best['batch']}, {best['speedup_vs_a']:.1f}x re-encoding",)


def _default_head_costs(d: dict) -> tuple:
    best = d["cost"]["ms_per_row_best"]
    return (f"{best[ACCURACY['default']]:.2f} ms/row at batch 64 on one thread, {best[ACCURACY['bf16']]:.2f} in "
            f"bfloat16", f"{_pct(d['accuracy'][ACCURACY['default']]['full train'])} on Banking77's test rows")


def _lm_judge(d: dict) -> tuple:
    a = d["accuracy"]
    return (f"{_pct(a['support LM (calibrated), 66 held-out'])} on the 66 held-out support tickets",
            f"{100 * a['banking77 LM scoring (shipped task, pruned), 100 random test rows']:.0f}% on 100 Banking77")


def _sizing(d: dict) -> tuple:
    run = next(r for r in d["runs"] if r["run"] == "classify, throughput")
    step, vcpus = run["step"], d["cpu_count"]
    loaded = sorted(w["peak_rss_mb"] for w in run["workers"] if w["peak_rss_mb"] > 1000)
    io_only = [w["peak_rss_mb"] for w in run["workers"] if w["peak_rss_mb"] <= 1000]
    every = [w["peak_rss_mb"] for r in d["runs"] for w in r["workers"] if w["peak_rss_mb"] > 1000]
    per_vcpu = run["rows_per_s"] / vcpus
    return (" and ".join(f"{m:,.0f}" for m in loaded) + " MB |",
            f"{min(io_only):.0f} to {max(io_only):.0f} MB |",
            f"{step['model_ms_per_row']:.1f} ms ({step['model_rows_per_s']:.1f} rows/s)",
            f"{step['startup_model_load_s']:.1f} s, {step['startup_prefix_build_s']:.1f} s, "
            f"{step['startup_self_check_s']:.1f} s",
            f"{run['rows']:,} rows in {run['wall_s']:.1f} s: {run['rows_per_s']:.1f} rows/s, {per_vcpu:.1f} per vCPU",
            f"at the whole job's {per_vcpu:.1f} rows/s per vCPU, {1e6 / per_vcpu / 3600:.1f} vCPU-hours",
            f"({step['model_rows_per_s']:.1f} rows/s per process, one process per vCPU",
            f"{1e6 / step['model_rows_per_s'] / 3600:.1f} vCPU-hours",
            f"peaked between {min(every):,.0f} and {max(every):,.0f} MB")


def _extraction_heads(d: dict) -> tuple:
    f1, ms, t = d["micro_f1"], d["ms_per_row"], d["tickets"]
    return (f"slot F1 ({f1['head, 70']:.3f}) is above every engine the benchmark published and above the CRF on "
            f"the same rows ({f1['CRF, 70']:.3f})",
            f"whole training file ({f1['head, all']:.3f}) they are above the published Snips NLU figure "
            f"({d['anchors']['Snips NLU (CRF)']['all']:.3f}) but under the CRF of this run ({f1['CRF, all']:.3f})",
            f"zero-shot ({f1['decoding']:.3f})", f"cost {ms['head, all']:.2f} ms", f"against decoding's "
            f"{ms['decoding']:.2f} ms", f"costs {ms['CRF, all']:.2f} ms",
            f"on {_pct(t['head']['all_fields_exact'])} of the held-out tickets, against "
            f"{_pct(t['decoding']['all_fields_exact'])} decoded, at {t['head']['ms_per_row']:.1f} against "
            f"{t['decoding']['ms_per_row']:.1f} ms/row")


def _extraction_readme(d: dict) -> tuple:
    f1, t = d["micro_f1"], d["tickets"]
    return (f"SNIPS slot F1 {f1['head, 70']:.3f} at 70 rows per intent", f"{_pct(t['head']['all_fields_exact'])} of "
            f"held-out tickets against {_pct(t['decoding']['all_fields_exact'])} decoded",)


def _ms(ms: float) -> str:
    return f"{ms:.0f}" if ms >= 1000 else f"{ms:.1f}"


def _speedup(d: dict) -> tuple:
    """docs/benchmarks.md's two `make bench` tables and the figures under them."""
    rows = tuple(f"| {_ms(c['ms_per_row'])} | {c['speedup_vs_a']:.1f}x | {100 * c['agreement']:.1f}% |"
                 for w in ("support", "banking77") for c in d["workloads"][w]["contenders"])
    support = d["workloads"]["support"]
    sliding = {(r["engine"], r["batch"]): f"{r['ms_per_row']:.0f}" for r in d["sliding"]["runs"]}
    return rows + (f"C is {support['best_c']['speedup_vs_a']:.1f}x A and {support['c_over_b']:.1f}x B",
                   f"at {support['floor']['c_percent_of_floor']:.0f}% of the FLOP floor "
                   f"({support['floor']['floor_ms_per_row']:.1f} ms/row at a measured "
                   f"{support['floor']['matmul_gflops']:.0f} GFLOP/s",
                   f"D/C throughput {support['d_over_c_throughput']:.2f}",
                   "shared-prefix attention " + " / ".join(sliding["shared", b] for b in (1, 8, 32)),
                   "the expanded working cache " + " / ".join(sliding["expanded", b] for b in (1, 8, 32)))


def _peers(d: dict) -> tuple:
    """docs/benchmarks.md's llama.cpp table: each contender's ms/row, ratio, GFLOP/s, agreement."""
    def agreement(x):
        return "100%" if x == 1.0 else f"{100 * x:.1f}%"
    return tuple(f"| {c['ms_per_row']:.1f} | {c['c_speed_vs']:.2f}x | {c['gflops']:.0f} | "
                 f"{agreement(c['agreement_with_c'])} |" for c in d["contenders"].values())


def _extraction_speed(d: dict) -> tuple:
    """docs/benchmarks.md's extraction table and C's time split."""
    ms, rounds, tps = d["ms_per_row"], d["rounds_ms_per_row"], d["generated_tokens_per_s"]
    split = d["c_time_split_s"]
    return (f"| {ms['A']:,.0f} ({rounds['A'][0]:,.0f}; {rounds['A'][1]:,.0f}) | {tps['A']:.1f} | "
            f"{d['c_over_a']:.1f}x faster",
            f"| {ms['B']:,.0f} ({rounds['B'][0]:,.0f}; {rounds['B'][1]:,.0f}) | {tps['B']:.1f} | "
            f"{d['c_over_b']:.1f}x faster",
            f"| {ms['C']:.1f} ({rounds['C'][0]:.0f}; {rounds['C'][1]:.0f}) | {tps['C']:.1f} |",
            f"{d['generated_tokens_per_row']:.1f} tokens generated per row",
            f"C's {split['total']:.1f} s for the {d['rows']} rows",
            f"the suffix pass {split['model: suffix pass']:.1f} s, the decode steps {split['model: decode steps']:.1f} s")


def _tagger_survey(d: dict) -> tuple:
    """history.md's table of the tagger survey: each tagger's three F1s, in a row."""
    f1 = d["span_f1_on_other_training_rows"]
    names = dict.fromkeys(k.rsplit(", transitions", 1)[0] for k in f1)
    return tuple(f"| {n} | " + " | ".join(f"{f1[f'{n}, transitions x{w}']:.4f}" for w in (0.0, 0.5, 1.0)) + " |"
                 for n in names)


def _linear_tagger(d: dict) -> tuple:
    f1 = d["micro_f1"]
    return (f"the linear tagger reached {f1['head, all']:.3f} span F1 on the test rows",
            f"under the CRF of the same run ({f1['CRF, all']:.3f};")


QUOTES = [
    ("docs/history.md", "tagger_survey", _tagger_survey),
    ("docs/history.md", "extraction_heads_linear", _linear_tagger),
    ("docs/benchmarks.md", "speedup", _speedup),
    ("docs/benchmarks.md", "peers", _peers),
    ("docs/benchmarks.md", "extraction", _extraction_speed),
    ("docs/extraction.md", "extraction_heads", _extraction_heads),
    ("README.md", "extraction_heads", _extraction_readme),
    ("docs/scale.md", "flink", _sizing),
    ("docs/models.md", "speedup", _default_costs),
    ("docs/models.md", "baselines_defaults", _default_head_costs),
    ("docs/models.md", "heads", _lm_judge),
    ("README.md", "baselines_defaults", _bf16_and_layers),
    ("docs/scale.md", "baselines_defaults", _bf16_heads),
    ("docs/heads.md", "baselines_defaults", _tuning_cost),
    ("docs/heads.md", "baselines", _tuning_cost_every_contender),
]


@pytest.mark.parametrize("page, name, quote", QUOTES, ids=[f"{p}:{n}:{q.__name__}" for p, n, q in QUOTES])
def test_a_figure_quoted_in_prose_is_its_results_files(page, name, quote):
    # (as wrapped anywhere, bold or not)
    text = " ".join((ROOT / page).read_text(encoding="utf-8").replace("**", "").split())
    for fragment in quote(_results(name)):
        fragment = " ".join(fragment.split())
        assert fragment in text, f"{page} does not say {fragment!r} (benchmarks/results/{name}.json)"


def _numbers_in(value, out: set) -> set:
    """Every number a results file holds (strings' decimals too: some reports carry tables)."""
    if isinstance(value, dict):
        for v in value.values():
            _numbers_in(v, out)
    elif isinstance(value, list):
        for v in value:
            _numbers_in(v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out.add(float(value))
    elif isinstance(value, str):
        out.update(float(m) for m in re.findall(r"\d+\.\d+", value))
    return out


FIGURE = re.compile(r"(\d+\.\d+)(%| ms/row)")
PROSE_PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "history.md")


@pytest.mark.parametrize("page", PROSE_PAGES)
def test_every_percentage_and_cost_a_page_states_is_in_a_results_file(page):
    """Beyond the quotes above: any ``NN.N%`` or ``N.NN ms/row`` a page states outside its code
    blocks (whose shown output a run prints) is some results file's value, at the precision
    shown (a fraction as a percentage too). A figure no run recorded fails here."""
    known: set = set()
    for path in RESULTS.rglob("*.json"):
        _numbers_in(json.loads(path.read_text(encoding="utf-8")), known)
    prose = re.sub(r"```.*?```", "", (ROOT / page).read_text(encoding="utf-8"), flags=re.S)
    unknown = []
    for m in FIGURE.finditer(prose):
        shown, places, percent = float(m.group(1)), len(m.group(1).split(".")[1]), m.group(2) == "%"
        if not any(round(v * scale, places) == shown for v in known for scale in ((1, 100) if percent else (1,))):
            unknown.append(m.group(0))
    assert not unknown, f"{page} states {unknown}, which no file in benchmarks/results holds"
