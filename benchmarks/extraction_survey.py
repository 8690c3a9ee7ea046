"""One-off survey (not a maintained suite): which layer and token window an extraction head's
span tagger should read, judged on SNIPS *training* rows only.

    python -m benchmarks.extraction_survey [--rows_per_intent 70 --validation_rows 300]

Per intent, the tagger (`extraction_fitting`'s logistic regression over each token's
windowed states, C=0.1) is fit on `rows_per_intent` random training rows (seed 0) and scored
(span F1, as `benchmarks.extraction_heads` scores) on `validation_rows` other training rows;
the test rows are never read. This chose `tagger_fitting.WINDOW` and
`tagger_candidates`; `benchmarks/results/extraction_survey.json`, cited by docs/history.md.
"""

from __future__ import annotations

import argparse
import datetime
import random

import numpy as np

from benchmarks.data import RESULTS, write_results
from benchmarks.extraction_heads import read, snips_task
from benchmarks.peers import _machine

LAYERS = (6, 12, 18, 24)
WINDOWS = ((0,), (0, 1), (0, 1, 2), (-1, 0, 1), (-1, 0, 1, 2))


def run(rows_per_intent: int = 70, validation_rows: int = 300, seed: int = 0) -> dict:
    from sklearn.linear_model import LogisticRegression

    from beam_prefix.engines.extraction_fitting import labelled_rows
    from beam_prefix.engines.extractor import Extractor
    from beam_prefix.engines.tagger_fitting import entity_counts, token_data
    from beam_prefix.model.loading import load_model
    from beam_prefix.tasks.span_tags import TagSet

    train = read("train.jsonl")
    loaded = load_model("embedded")
    totals: dict = {}
    for intent in sorted({r["intent"] for r in train}):
        rows = [r for r in train if r["intent"] == intent]
        random.Random(seed).shuffle(rows)
        fit_rows, check_rows = rows[:rows_per_intent], rows[rows_per_intent:rows_per_intent + validation_rows]
        slots = sorted({e["label"] for r in rows for e in r["entities"]})
        ex = Extractor(task=snips_task(intent, slots), loaded=loaded, verify=False, batch_size=32)
        tags = TagSet(tuple(slots))
        parts = {}
        for name, chosen in (("fit", fit_rows), ("check", check_rows)):
            labelled = labelled_rows(ex.task, [{"text": r["text"], "entities": r["entities"]} for r in chosen])
            encoded = [ex.encode(r.text) for r in labelled]
            parts[name] = (ex.states_encoded(encoded, LAYERS), [ex.layout.text_offsets(e) for e in encoded],
                           [r.spans for r in labelled], [e.text for e in encoded])
        for layer in LAYERS:
            for window in WINDOWS:
                data = {n: token_data(tags, s, o, sp, list(LAYERS), (layer,), window) for n, (s, o, sp, _) in parts.items()}
                x = np.concatenate([d[0][d[2]] for d in data["fit"]])
                y = np.concatenate([d[1][d[2]] for d in data["fit"]])
                mean, std = x.mean(0), x.std(0)
                std[std < 1e-6] = 1.0
                model = LogisticRegression(C=0.1, max_iter=1000).fit((x - mean) / std, y)
                counts = np.zeros(3, dtype=int)
                for (feats, _, mask), offsets, spans, text in zip(data["check"], *parts["check"][1:]):
                    log_probs = np.full((len(feats), tags.size), -1e9)
                    with np.errstate(divide="ignore"):
                        log_probs[:, model.classes_] = model.predict_log_proba((feats - mean) / std)
                    counts += entity_counts(tags, log_probs, offsets, mask, spans, text)
                key = f"layer {layer}, window {list(window)}"
                totals[key] = totals.get(key, np.zeros(3, dtype=int)) + counts
    f1 = {k: round(2 * int(c[0]) / max(int(c[1] + c[2]), 1), 4) for k, c in totals.items()}
    report = {"date": datetime.date.today().isoformat(), "machine": _machine(), "rows_per_intent": rows_per_intent,
              "validation_rows_per_intent": validation_rows, "seed": seed, "C": 0.1,
              "span_f1_on_other_training_rows": f1,
              "command": f"python -m benchmarks.extraction_survey --rows_per_intent {rows_per_intent} "
                         f"--validation_rows {validation_rows}"}
    lines = [f"# Extraction tagger survey ({report['date']})", "", f"`{report['command']}` on {report['machine']}: "
             f"span F1 on {validation_rows} other training rows per intent (SNIPS test rows not read).", "",
             "| layer | " + " | ".join(str(list(w)) for w in WINDOWS) + " |", "| --- |" + " --- |" * len(WINDOWS)]
    for layer in LAYERS:
        lines.append(f"| {layer} | " + " | ".join(f"{f1[f'layer {layer}, window {list(w)}']:.3f}" for w in WINDOWS) + " |")
    write_results(RESULTS, "extraction_survey", report, "\n".join(lines) + "\n")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows_per_intent", type=int, default=70)
    parser.add_argument("--validation_rows", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(run(a.rows_per_intent, a.validation_rows, a.seed)["span_f1_on_other_training_rows"])


if __name__ == "__main__":
    main()
