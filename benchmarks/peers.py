"""Our engine against llama.cpp on the same model, rows and prompt token ids.

    python -m benchmarks.peers                  # the support task, 300 rows, 3 rounds
    make bench-peers                            # the same, installing llama-cpp-python first

One driver, two worker processes (`benchmarks.peer_worker`): ours (C: `PrefixClassifier.classify`
at batch 64 and at batch 1, fp32, as `load_model` loads it by default: linear weights prepacked
for oneDNN and linears that share an input grouped into one GEMM; then without the grouping,
and without prepacking: what each buys) and llama.cpp (L, `benchmarks.llama_cpp_peer`: its
batched path over a shared prefix and its high-level one-row path, each with flash attention
on and off, on the embedded GGUF re-quantized by llama.cpp's quantizer to F32, Q8_0 and Q4_0). Both
get the same threads; the driver runs one contender at a time, in interleaved rounds, and
reports each one's best round, so drift of the machine's speed moves no ratio.

Checked on every row: llama.cpp's tokenizer gives our prompt token ids for the whole prompt
(the contenders are then fed those ids). Reported: ms/row, C's speed relative to each
contender (its ms/row over C's at the same batch class), effective GFLOP/s (2 x non-embedding
parameters x suffix tokens per row) and each contender's label agreement with C's
uncalibrated labels. With `--profile`, our per-op profile at batch 64 and 1 for each variant.
llama-cpp-python missing: L is skipped with a line saying so.

Writes `peers.json` and `peers.md` under `--out_dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from benchmarks.data import ROOT, TASKS, RESULTS, sample_tickets


class Worker:
    """A benchmark worker process spoken to by JSON lines: `benchmarks.peer_worker` by
    default, or `command` (the arguments after the interpreter) run with `tree` as its
    working directory and PYTHONPATH (`benchmarks.against_commit`: another commit's tree)."""

    def __init__(self, threads: int, *, command: tuple[str, ...] = ("-m", "benchmarks.peer_worker"),
                 tree: str = ROOT):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=tree)
        self.proc = subprocess.Popen([sys.executable, *command], cwd=tree, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a benchmark worker died on {cmd['op']!r} (exit {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def _agreement(a: list[str], b: list[str]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def _machine() -> str:
    from benchmarks.speedup import _native_bf16

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() + ", " for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return (f"{model}{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
            + (", native bf16" if _native_bf16() else ", no native bf16"))


def _gguf(model: str, given: str | None) -> str | None:
    if given:
        return given
    if model.endswith(".gguf"):
        return model
    if model == "embedded":
        from beam_prefix.model.loading import embedded_gguf_path

        return embedded_gguf_path()
    return None


def run(argv=None) -> dict:
    from beam_prefix.model.loading import cache_root
    from benchmarks import llama_cpp_peer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--gguf", default=None, help="the GGUF of --model for llama.cpp (embedded: its own)")
    parser.add_argument("--task", default=os.path.join(TASKS, "support_tickets.yaml"))
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="F32,Q8_0,Q4_0", type=lambda s: [k for k in s.split(",") if k])
    parser.add_argument("--one_row", default="F32", type=lambda s: [k for k in s.split(",") if k],
                        help="kinds that also get the high-level one-row path")
    parser.add_argument("--profile", action="store_true", help="our per-op profile at --batch and at 1")
    parser.add_argument("--profile_rows", type=int, default=128)
    parser.add_argument("--out_dir", default=RESULTS)
    args = parser.parse_args(argv)
    unknown = set(args.kinds) - set(llama_cpp_peer.KINDS)
    if unknown:
        raise SystemExit(f"--kinds: unknown {sorted(unknown)} (known: {', '.join(llama_cpp_peer.KINDS)})")

    texts = sample_tickets(args.rows)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(), "threads": args.threads,
              "rows": args.rows, "batch": args.batch, "rounds": args.rounds, "task": os.path.basename(args.task),
              "skipped": None, "contenders": {}}
    ours = Worker(args.threads)
    workers, one_row = {}, {}  # contender -> its worker; contender -> compared with C at batch 1
    try:
        info = ours.ask(op="ours", model=args.model, task=args.task, texts=texts, batches=[args.batch, 1],
                        threads=args.threads)
        report.update(model=info["model_id"], prefix_tokens=len(info["prefix_ids"]),
                      suffix_tokens_per_row=sum(map(len, info["suffix_ids"])) / args.rows,
                      non_embedding_params=info["non_embedding_params"])
        workers.update({name: ours for name in info["contenders"]})
        one_row.update(info["contenders"])
        gguf = _gguf(args.model, args.gguf)
        report["skipped"] = llama_cpp_peer.available() or (None if gguf else "llama.cpp contenders skipped: "
                                                           "no GGUF for this model (give --gguf)")
        if report["skipped"] is None and args.kinds:
            llama = Worker(args.threads)
            answer = llama.ask(op="llama", gguf=gguf, cache_dir=os.path.join(cache_root(), "peers"),
                               kinds=args.kinds, one_row=args.one_row, batch=args.batch, threads=args.threads,
                               prefix_ids=info["prefix_ids"], suffix_ids=info["suffix_ids"],
                               prompts=info["prompts"], label_first_ids=info["label_first_ids"],
                               labels=info["labels"])
            report["token_mismatches"] = answer["token_mismatches"]
            if any(answer["token_mismatches"].values()):
                raise SystemExit(f"llama.cpp tokenizes the prompts differently: {answer['token_mismatches']} rows")
            workers.update({name: llama for name in answer["contenders"]})
            one_row.update(answer["contenders"])
        elif report["skipped"]:
            print(report["skipped"], file=sys.stderr)

        times: dict[str, list[float]] = {name: [] for name in workers}
        labels: dict[str, list[str]] = {}
        for r in range(args.rounds):
            for name, worker in workers.items():
                answer = worker.ask(op="run", name=name)
                times[name].append(answer["ms_per_row"])
                labels[name] = answer["labels"]
            print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.1f}" for n, t in times.items()), file=sys.stderr)
        if args.profile:
            # batch 1 records one forward's ops per row: fewer rows keep the profiler's memory small
            report["profile"] = [ours.ask(op="profile", batch=b, variant=variant,
                                          rows=min(args.profile_rows if b > 1 else max(1, args.profile_rows // 8), args.rows))
                                 for b in (args.batch, 1) for variant in ("plain", "ungrouped", "loaded")]
    finally:
        for worker in {id(w): w for w in list(workers.values()) + [ours]}.values():
            worker.close()

    reference = labels[f"C batch {args.batch}"]
    flop_per_row = 2 * report["non_embedding_params"] * report["suffix_tokens_per_row"]
    for name, ts in times.items():
        best = min(ts)
        c_ms = min(times["C batch 1" if one_row[name] else f"C batch {args.batch}"])
        report["contenders"][name] = {"ms_per_row": best, "rounds": ts, "c_speed_vs": best / c_ms,
                                      "gflops": flop_per_row / (best * 1e6),
                                      "agreement_with_c": _agreement(labels[name], reference)}
    markdown = _markdown(report)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "peers.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out_dir, "peers.md"), "w", encoding="utf-8") as f:
        f.write(markdown + "\n")
    print(markdown)
    return report


_VARIANT_NAMES = {"plain": "weights not prepacked (plain F.linear)",
                  "ungrouped": "weights prepacked, siblings not grouped",
                  "loaded": "weights prepacked, siblings grouped (as loaded)"}


def _markdown(report: dict) -> str:
    from benchmarks.op_profile import markdown as profile_markdown

    lines = [f"# Ours against llama.cpp ({report['date']}, {report['machine']}, {report['threads']} threads each)",
             "", f"{report['model']}, task `{report['task']}`: {report['rows']} rows, prefix "
             f"{report['prefix_tokens']} tokens, {report['suffix_tokens_per_row']:.1f} suffix tokens per row; "
             f"best of {report['rounds']} interleaved rounds, one run. *C vs it*: its ms/row over C's "
             f"(batch {report['batch']} for batched contenders, batch 1 for one-row ones); above 1, C is faster.", ""]
    if report["skipped"]:
        lines += [report["skipped"], ""]
    elif "token_mismatches" in report:
        lines += ["llama.cpp's tokenizer gave our prompt ids on every row (mismatches: "
                  + ", ".join(f"{k} {v}" for k, v in report["token_mismatches"].items()) + ").", ""]
    lines += ["| contender | ms/row | C vs it | GFLOP/s | labels = C's (uncalibrated) |",
              "| --- | --- | --- | --- | --- |"]
    for name, c in report["contenders"].items():
        lines.append(f"| {name} | {c['ms_per_row']:.1f} | {c['c_speed_vs']:.2f}x | {c['gflops']:.0f} | "
                     f"{100 * c['agreement_with_c']:.1f}% |")
    for prof in report.get("profile", ()):
        lines += ["", f"## Our per-op profile, {_VARIANT_NAMES[prof['variant']]}, " + profile_markdown(prof)]
    return "\n".join(lines)


if __name__ == "__main__":
    run()
