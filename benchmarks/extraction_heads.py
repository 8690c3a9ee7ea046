"""Extraction heads on SNIPS: slot F1 of a head fit on labelled rows, a CRF and constrained decoding.

    python -m benchmarks.extraction_heads [--rows_per_intent 70 --seed 0 --timed_rows 100 --rounds 2]
    make bench-extraction

Data: five intents of the SNIPS NLU benchmark (``pipelines/data/snips``, CC0; Coucke et
al. 2018, arXiv 1805.10190): ``train.jsonl`` fits, ``test.jsonl`` (100 rows per intent)
is only ever scored. Each intent is its own extraction task (its slots are string
fields), so each gets its own head, as the benchmark's engines do. Contenders, on the
same rows in one run:

- **head, 70 rows per intent** and **head, whole training set**: `fit_extraction_head`
  on the embedded model (span tagger's layers, classifier and transition weight chosen
  by folds), then
  `Extractor` with ``scoring: head`` (one suffix pass per row, no decoding);
- **CRF, 70 rows** and **CRF, whole set**: a linear-chain CRF on word features
  (python-crfsuite; the word, its shape, prefixes and suffixes, two words either side);
- **decoding**: the same task decoded by the embedded model under the JSON schema (no
  training rows; zero-shot).

The shipped ticket task too: a head fit on ``pipelines/data/ticket_fields_train.jsonl`` (80
hand-labelled tickets) against the task's constrained decoding, field by field, on the
gold tickets the head never saw (``ticket_fields_gold.jsonl`` less the training rows: the
66 held-out tickets and 20 more), each field beside its majority value.

Score: entity-level micro F1 on the test rows, a slot right when its label and its text
are exactly the gold span's, beside the benchmark's published figures (the anchors).
Cost: ms per row on `timed_rows` test rows per intent, the contenders timed in
interleaved rounds, each one's best round.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import re
import time

import torch

from benchmarks.data import DATA, RESULTS, write_results
from benchmarks.peers import _machine

__all__ = ["run", "ANCHORS", "f1_counts", "crf_features"]

SNIPS = os.path.join(DATA, "snips")
# the benchmark's published slot F1 (frequency-weighted over these five intents' slots):
# pipelines/data/snips/README.md
ANCHORS = {"Snips NLU (CRF)": {"70": 0.837, "all": 0.940}, "LUIS": {"70": 0.801}, "api.ai": {"70": 0.788},
           "Wit": {"70": 0.677}, "Alexa": {"70": 0.598}}


def read(name: str) -> list[dict]:
    with open(os.path.join(SNIPS, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def snips_task(intent: str, slots: list[str]):
    from beam_prefix.tasks.extract_task import load_task

    return load_task({"kind": "extract", "name": intent,
                      "instructions": "Find the parts of this request to a voice assistant.",
                      "fields": [{"name": s, "type": "string", "required": False,
                                  "description": s.replace("_", " ")} for s in slots],
                      "suffix_template": "Request: {text}", "max_new_tokens": 96})


def gold(row: dict) -> set:
    return {(e["label"], e["value"]) for e in row["entities"]}


def f1_counts(predicted: set, wanted: set) -> tuple[int, int, int]:
    """(true positives, predicted, gold) slots of one row."""
    return len(predicted & wanted), len(predicted), len(wanted)


def f1(counts) -> float:
    tp, predicted, wanted = counts
    return round(2 * tp / max(predicted + wanted, 1), 4)


# -- the CRF baseline ------------------------------------------------------------------------

_WORD = re.compile(r"\w+|[^\w\s]")


def _words(text: str):
    return [(m.group(), m.start(), m.end()) for m in _WORD.finditer(text)]


def crf_features(words: list[str]) -> list[list[str]]:
    """Each word's features: the word, its shape, prefixes and suffixes, two words either side."""
    def shape(w):
        return re.sub(r"[A-Z]+", "A", re.sub(r"[a-z]+", "a", re.sub(r"[0-9]+", "0", w)))

    out = []
    for i, w in enumerate(words):
        f = [f"w={w.lower()}", f"shape={shape(w)}", f"p3={w[:3].lower()}", f"s3={w[-3:].lower()}",
             f"s2={w[-2:].lower()}", f"title={w.istitle()}", f"digit={w.isdigit()}"]
        for d in (-2, -1, 1, 2):
            j = i + d
            f.append(f"w{d}={words[j].lower()}" if 0 <= j < len(words) else f"w{d}=<edge>")
        f.append(f"w-1w={words[i - 1].lower() if i else '<edge>'}|{w.lower()}")
        out.append(f)
    return out


def _crf_tags(row: dict) -> tuple[list, list[str]]:
    words = _words(row["text"])
    tags, previous = [], None
    for _, start, end in words:
        label = next((e["label"] for e in row["entities"] if start < e["end"] and end > e["start"]), None)
        tags.append("O" if label is None else ("I-" if label == previous else "B-") + label)
        previous = label
    return words, tags


def fit_crf(rows: list[dict], path: str):
    import pycrfsuite

    trainer = pycrfsuite.Trainer(verbose=False)
    for row in rows:
        words, tags = _crf_tags(row)
        trainer.append(crf_features([w for w, _, _ in words]), tags)
    trainer.set_params({"c1": 0.1, "c2": 0.01, "max_iterations": 200})
    trainer.train(path)
    tagger = pycrfsuite.Tagger()
    tagger.open(path)
    return tagger


def crf_slots(tagger, text: str) -> set:
    words = _words(text)
    tags = tagger.tag(crf_features([w for w, _, _ in words]))
    found, current = {}, None
    for (_, start, end), tag in zip(words, tags):
        if tag.startswith("B-") or (tag.startswith("I-") and (current is None or current[0] != tag[2:])):
            current = [tag[2:], start, end]
            found.setdefault(current[0], current)
        elif tag.startswith("I-"):
            current[2] = end
        else:
            current = None
    return {(label, text[s:e]) for label, s, e in found.values()}


# -- the run ---------------------------------------------------------------------------------

TICKETS_TRAIN = os.path.join(DATA, "ticket_fields_train.jsonl")


def tickets(loaded) -> dict:
    """The ticket task's head against its decoding on the gold tickets the head never saw."""
    from beam_prefix.engines.extraction_fitting import fit_extraction_head
    from beam_prefix.engines.extractor import Extractor
    from beam_prefix.tasks.extract_task import load_task
    from benchmarks.extraction import GOLD, accuracy

    with open(TICKETS_TRAIN, encoding="utf-8") as f:
        train = [json.loads(line) for line in f if line.strip()]
    with open(GOLD, encoding="utf-8") as f:
        gold = [json.loads(line) for line in f if line.strip()]
    task = load_task("ticket_fields")
    decoder = Extractor(task=task, loaded=loaded, verify=False, batch_size=32)
    start = time.perf_counter()
    head = fit_extraction_head(decoder, train)
    fit_s = time.perf_counter() - start
    held = [r for r in gold if not head.trained_on(r["text"])]
    headed = Extractor(task=task.replace(scoring="head", head=head), loaded=loaded, verify=True, batch_size=32)
    texts = [r["text"] for r in held]
    out = {"train_rows": len(train), "held_out_rows": len(held), "fit_s": round(fit_s, 1), "head_metrics": head.metrics}
    for name, ex in (("decoding", decoder), ("head", headed)):
        start = time.perf_counter()
        out[name] = accuracy(ex, rows=held)
        out[name]["ms_per_row"] = round(1e3 * (time.perf_counter() - start) / len(texts), 2)
    return out


def _slots(extraction) -> set:
    return {(k, v) for k, v in (extraction.values or {}).items() if v is not None}


def run(rows_per_intent: int = 70, seed: int = 0, timed_rows: int = 100, rounds: int = 2, name: str = "extraction_heads",
        intents: list[str] | None = None, train_limit: int | None = None, model: str = "embedded",
        out_dir: str = RESULTS) -> dict:
    import tempfile

    from beam_prefix.engines.extraction_fitting import fit_extraction_head
    from beam_prefix.engines.extractor import Extractor
    from beam_prefix.model.loading import load_model

    train, test = read("train.jsonl"), read("test.jsonl")
    intents = intents or sorted({r["intent"] for r in test})
    loaded = load_model(model)
    counts = collections.defaultdict(lambda: [0, 0, 0])
    per_intent, fits, times = {}, {}, collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as scratch:
        for intent in intents:
            rows = [r for r in train if r["intent"] == intent][:train_limit]
            held = [r for r in test if r["intent"] == intent]
            slots = sorted({e["label"] for r in rows + held for e in r["entities"]})
            few = random.Random(seed).sample(rows, min(rows_per_intent, len(rows)))
            task = snips_task(intent, slots)
            decoder = Extractor(task=task, loaded=loaded, verify=False, batch_size=32)
            engines, taggers = {}, {}
            for size, chosen in (("70", few), ("all", rows)):
                start = time.perf_counter()
                head = fit_extraction_head(decoder, [{"text": r["text"], "entities": r["entities"]} for r in chosen])
                fits[f"{intent} head {size}"] = {"fit_s": round(time.perf_counter() - start, 1), "rows": len(chosen),
                                                 "tagger": head.metrics["tagger"]}
                engines[f"head, {size}"] = Extractor(task=task.replace(scoring="head", head=head), loaded=loaded,
                                                     verify=True, batch_size=32)
                taggers[f"CRF, {size}"] = fit_crf(chosen, os.path.join(scratch, f"{intent}-{size}.crf"))
            texts = [r["text"] for r in held]
            answers = {k: [_slots(e) for e in ex.extract(texts)] for k, ex in engines.items()}
            answers.update({k: [crf_slots(t, x) for x in texts] for k, t in taggers.items()})
            answers["decoding"] = [_slots(e) for e in decoder.extract(texts)]
            per_intent[intent] = {}
            for k, found in answers.items():
                c = [sum(x) for x in zip(*(f1_counts(p, gold(r)) for p, r in zip(found, held)))]
                per_intent[intent][k] = f1(c)
                counts[k] = [a + b for a, b in zip(counts[k], c)]
            timed = texts[:timed_rows]
            calls = {**{k: (lambda ex=ex: ex.extract(timed)) for k, ex in engines.items()},
                     **{k: (lambda t=t: [crf_slots(t, x) for x in timed]) for k, t in taggers.items()},
                     "decoding": lambda: decoder.extract(timed)}
            for _ in range(rounds):  # interleaved: every contender once per round
                for k, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[k, intent].append(1e3 * (time.perf_counter() - start) / len(timed))
    ticket_report = tickets(loaded)
    order = ["head, 70", "head, all", "CRF, 70", "CRF, all", "decoding"]
    ms = {k: round(sum(min(times[k, i]) for i in intents) / len(intents), 2) for k in order}
    report = {"date": datetime.date.today().isoformat(), "machine": _machine(), "torch_threads": torch.get_num_threads(),
              "model": "embedded (SmolLM2-135M-Instruct), float32" if model == "embedded" else model, "intents": intents,
              "rows_per_intent": rows_per_intent, "seed": seed, "test_rows": len([r for r in test if r["intent"] in intents]),
              "micro_f1": {k: f1(counts[k]) for k in order}, "ms_per_row": ms, "per_intent_f1": per_intent,
              "fits": fits, "anchors": ANCHORS, "tickets": ticket_report,
              "command": f"python -m benchmarks.extraction_heads --rows_per_intent {rows_per_intent} --seed {seed}"}
    write_results(out_dir, name, report, _markdown(report))
    return report


def _markdown(r: dict) -> str:
    lines = [f"# Extraction heads on SNIPS ({r['date']})", "",
             f"`{r['command']}` on {r['machine']}, {r['torch_threads']} torch threads; {r['model']}. "
             f"Slot F1: entity-level micro F1 on the {r['test_rows']} test rows (label and exact text). "
             f"ms/row: the mean over intents of each contender's best of interleaved rounds.", "",
             "| contender | slot F1 | ms/row |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v:.3f} | {r['ms_per_row'][k]:.2f} |" for k, v in r["micro_f1"].items()]
    lines += ["", "Published (the benchmark's engines, frequency-weighted slot F1):", "",
              "| engine | 70 rows per intent | whole training set |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v['70']:.3f} | {v['all']:.3f} |" if "all" in v else f"| {k} | {v['70']:.3f} | |"
              for k, v in r["anchors"].items()]
    t = r["tickets"]
    lines += ["", f"The shipped ticket task (`ticket_fields`): exact match per field on the {t['held_out_rows']} gold "
                  f"tickets the head never saw (it was fit on {t['train_rows']}):", "",
              "| field | decoding | head | majority value |", "| --- | --- | --- | --- |"]
    for name, d in t["decoding"]["fields"].items():
        h = t["head"]["fields"][name]
        lines.append(f"| {name} | {d['exact']:.1%} | {h['exact']:.1%} | {d['majority_baseline']:.1%} "
                     f"({json.dumps(d['majority_value'])}) |")
    lines += [f"| all five fields | {t['decoding']['all_fields_exact']:.1%} | {t['head']['all_fields_exact']:.1%} | |",
              f"| ms/row | {t['decoding']['ms_per_row']:.1f} | {t['head']['ms_per_row']:.1f} | |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows_per_intent", type=int, default=70)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timed_rows", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--intents", default=None, help="comma-separated (default: all five)")
    parser.add_argument("--train_limit", type=int, default=None, help="at most this many training rows per intent")
    parser.add_argument("--name", default="extraction_heads")
    a = parser.parse_args()
    report = run(a.rows_per_intent, a.seed, a.timed_rows, a.rounds, a.name,
                 a.intents.split(",") if a.intents else None, a.train_limit)
    print(_markdown(report))


if __name__ == "__main__":
    main()
