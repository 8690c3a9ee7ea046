"""Extraction benchmark: speed of three ways to run the same constrained extraction, and
the shipped task's field accuracy on hand-labelled tickets.

    python -m benchmarks.extraction [--rows 60 --a_rows 20 --rounds 2 --batch_size 16]

Contenders, timed in interleaved rounds in one process, on the same rows:

- **A**: every row's whole prompt re-encoded, then greedy decoding on the model's own
  cache with the schema constraint (`Extractor.extract_full`);
- **B**: Hugging Face `generate` per row over a copy of the prefix's `DynamicCache` (the
  well-known recipe), greedy, with the same constraint as a logits processor;
- **C**: `Extractor.extract`, rows batched over the shared batch-1 prefix.

Every contender's generated tokens must equal C's (reported as `identical`). Speed is
reported per row and as generated tokens per second; a separate, instrumented pass of C
shows where its time goes (the suffix pass, the decode steps, the prefix-attention part
of both, the vocabulary head, the grammar masks). Accuracy: C over the 40 tickets of
`pipelines/data/ticket_fields_gold.jsonl`, field by field (exact match, null included),
beside the majority-value baseline of each field.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import json
import logging
import os
import platform
import time

import torch

from benchmarks.data import DATA, TASKS, RESULTS

__all__ = ["run"]

_LOGGER = logging.getLogger(__name__)
GOLD = os.path.join(DATA, "ticket_fields_gold.jsonl")


def recipe(ex, texts) -> list[tuple[int, ...]]:
    """B: per row, `model.generate` over a deep copy of the prefix cache, the schema as a
    logits processor; returns each row's generated tokens (a closing end-of-text left out)."""
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria

    model, prefix_ids = ex.model, list(ex.layout.prefix_ids)
    with torch.inference_mode():
        prefix_cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix_ids]), cache=prefix_cache, use_cache=True)

    class Processor(LogitsProcessor):
        """The schema's mask on each step's scores; feeds the matcher what was generated."""

        def __init__(self, start: int):
            self.matchers, self.start, self.fed = ex.constraint.matchers(1), start, 0

        def sync(self, input_ids):
            for token in input_ids[0, self.start + self.fed:].tolist():
                self.matchers.advance(0, token)
                self.fed += 1

        def __call__(self, input_ids, scores):
            self.sync(input_ids)
            return torch.from_numpy(self.matchers.mask(scores, [0]))

    class Stop(StoppingCriteria):
        """Ends generation once the object closes (as C's matcher does)."""

        def __init__(self, processor: Processor):
            self.processor = processor

        def __call__(self, input_ids, scores, **kwargs):
            self.processor.sync(input_ids)
            return torch.tensor([self.processor.matchers.stopped(0)])

    out = []
    with torch.inference_mode():
        for text in texts:
            suffix = list(ex.encode(text).suffix_ids)
            ids = torch.tensor([prefix_ids + suffix])
            processor = Processor(ids.shape[1])
            generated = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), cache=copy.deepcopy(prefix_cache),
                max_new_tokens=ex.task.max_new_tokens, do_sample=False, num_beams=1,
                logits_processor=LogitsProcessorList([processor]), stopping_criteria=[Stop(processor)],
                eos_token_id=sorted(ex.constraint.eos_ids), pad_token_id=sorted(ex.constraint.eos_ids)[0])
            out.append(tuple(generated[0, ids.shape[1]:].tolist()))
    return out


def _timed(fn, rows: int):
    start = time.perf_counter()
    result = fn()
    return result, 1e3 * (time.perf_counter() - start) / rows


@contextlib.contextmanager
def _profiled():
    """Seconds spent in the parts of C's decoding, by part (wrappers on module functions)."""
    from beam_prefix.model import attention
    from beam_prefix.engines import constraints
    from beam_prefix.engines import decoding
    from beam_prefix.model import output_head

    spent = collections.Counter()
    patched = []

    def wrap(owner, name, key):
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                spent[key(*args, **kwargs) if callable(key) else key] += time.perf_counter() - start

        setattr(owner, name, timed)
        patched.append((owner, name, real))

    wrap(decoding, "forward", lambda model, prefix, step, **kw: "model: suffix pass" if step.causal
         else "model: decode steps")
    wrap(attention, "_prefix_part", "of which prefix attention")
    wrap(output_head.OutputHead, "logits", "vocabulary head (rows with many allowed tokens)")
    wrap(output_head.OutputHead, "logits_for", "vocabulary head (rows with few allowed tokens)")
    wrap(constraints.RowMatchers, "fill", "grammar masks")
    try:
        yield spent
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


def accuracy(ex, gold_path: str = GOLD, rows: list[dict] | None = None) -> dict:
    """Field-level exact match of `ex` over the gold tickets (or `rows` of them), with each
    field's majority baseline."""
    if rows is None:
        rows = [json.loads(line) for line in open(gold_path, encoding="utf-8")]
    got = ex.extract([r["text"] for r in rows])
    out = {"rows": len(rows), "closed": sum(g.finished and g.problem is None for g in got), "fields": {}}
    for name in ex.task.field_names:
        gold = [r[name] for r in rows]
        pred = [g.values[name] if g.values else "<no output>" for g in got]
        majority = collections.Counter(json.dumps(v) for v in gold).most_common(1)[0]
        out["fields"][name] = {"exact": sum(p == g for p, g in zip(pred, gold)) / len(rows),
                               "majority_baseline": majority[1] / len(rows), "majority_value": json.loads(majority[0]),
                               "predicted": dict(collections.Counter(json.dumps(p) for p in pred).most_common(5))}
    out["all_fields_exact"] = sum(g.values is not None and all(g.values[n] == r[n] for n in ex.task.field_names)
                                  for g, r in zip(got, rows)) / len(rows)
    return out


def run(argv=None) -> dict:
    args = _parser().parse_args(argv)
    from beam_prefix.tasks.extract_task import load_task
    from beam_prefix.engines.extractor import Extractor
    from beam_prefix.model.loading import load_model
    import pyarrow.parquet as pq

    if args.threads:
        torch.set_num_threads(args.threads)
    task = load_task(args.task)
    ex = Extractor(task=task, loaded=load_model(args.model), batch_size=args.batch_size, verify=False)
    texts = [r["text"] for r in pq.read_table(os.path.join(DATA, "sample_tickets.parquet"))
             .to_pylist()][:args.rows]
    a_texts = texts[:args.a_rows]
    # warm-up: each contender once
    ex.extract(texts[:2])
    ex.extract_full(texts[:1])
    recipe(ex, texts[:1])
    runs = {"A": [], "B": [], "C": []}
    for r in range(args.rounds):
        a, ms = _timed(lambda: ex.extract_full(a_texts), len(a_texts))
        runs["A"].append(ms)
        b, ms = _timed(lambda: recipe(ex, texts), len(texts))
        runs["B"].append(ms)
        c, ms = _timed(lambda: ex.extract(texts), len(texts))
        runs["C"].append(ms)
        _LOGGER.info("round %d: A %.0f, B %.0f, C %.0f ms/row", r + 1, runs["A"][-1], runs["B"][-1], runs["C"][-1])
    c_tokens = [x.tokens for x in c]
    eos = ex.constraint.eos_ids
    b_tokens = [t[:-1] if t and t[-1] in eos and (not ct or ct[-1] not in eos) else t for t, ct in zip(b, c_tokens)]
    generated = sum(len(t) for t in c_tokens)
    a_generated = sum(len(x.tokens) for x in a)
    best = {k: min(v) for k, v in runs.items()}
    with _profiled() as spent:
        start = time.perf_counter()
        ex.extract(texts)
        total = time.perf_counter() - start
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "model": ex.model_id, "task": task.name,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "rows": len(texts), "a_rows": len(a_texts),
        "batch_size": args.batch_size, "prefix_tokens": ex.prefix_length, "max_new_tokens": task.max_new_tokens,
        "rounds_ms_per_row": runs, "ms_per_row": best,
        "generated_tokens_per_row": generated / len(texts),
        "generated_tokens_per_s": {"A": a_generated / len(a_texts) / best["A"] * 1e3,
                                   "B": generated / len(texts) / best["B"] * 1e3,
                                   "C": generated / len(texts) / best["C"] * 1e3},
        "c_over_a": best["A"] / best["C"], "c_over_b": best["B"] / best["C"],
        "identical": {"A": [x.tokens for x in a] == c_tokens[:len(a_texts)], "B": b_tokens == c_tokens},
        "c_time_split_s": {k: round(v, 3) for k, v in spent.items()} | {"total": round(total, 3)},
        "accuracy": accuracy(ex, args.gold),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "extraction.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.extraction", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--task", default=os.path.join(TASKS, "ticket_fields.yaml"))
    parser.add_argument("--gold", default=GOLD)
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--a_rows", type=int, default=20, help="rows for A (the slowest), the first of --rows")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out_dir", default=RESULTS)
    return parser


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    run()
