"""One-off survey (not a maintained suite): which span tagger reads SNIPS best when there are
thousands of labelled rows, judged on SNIPS *training* rows only.

    python -m benchmarks.tagger_survey [--fit_rows 1500 --check_rows 300]

Per intent (seed 0 shuffle of its training rows), taggers are fit on the first `fit_rows`
and scored (span F1, exact span and field) on the last `check_rows`; the test rows are
never read. Compared: layers 12, 18 and both; a logistic regression (C 0.1), and (layers
12, and both) with hashed word features (the word, its neighbours and the bigrams, 2^16 buckets); one
hidden layer of GELUs (256 wide, dropout 0.3, weight decay 1e-2; 512 wide, dropout 0.5,
weight decay 1e-3; 15 epochs of AdamW); each decoded with the learned tag transitions
weighted 0, 0.5 and 1. It led to `tagger_fitting.TAGGER_KINDS` (the 512-wide hidden layer
beside the linear ones), the joined-layers candidate and `TRANSITION_WEIGHTS`
(docs/history.md). Run on 2026-12-07 as two scripts (the linear and word-feature variants,
then the hidden layers) with this code; `benchmarks/results/tagger_survey.json`.
"""

from __future__ import annotations

import argparse
import datetime
import random

import numpy as np

from benchmarks.data import RESULTS, write_results
from benchmarks.extraction_heads import read, snips_task
from benchmarks.peers import _machine

LAYERS = (12, 18)
WINDOW = (-1, 0, 1)


def _states(fit_rows: int, check_rows: int, seed: int) -> dict:
    from beam_prefix.engines.extraction_fitting import labelled_rows
    from beam_prefix.engines.extractor import Extractor
    from beam_prefix.model.loading import load_model

    train = read("train.jsonl")
    loaded = load_model("embedded")
    parts = {}
    for intent in sorted({r["intent"] for r in train}):
        rows = [r for r in train if r["intent"] == intent]
        random.Random(seed).shuffle(rows)
        slots = sorted({e["label"] for r in rows for e in r["entities"]})
        ex = Extractor(task=snips_task(intent, slots), loaded=loaded, verify=False, batch_size=32)
        for name, chosen in (("fit", rows[:fit_rows]), ("check", rows[-check_rows:])):
            labelled = labelled_rows(ex.task, [{"text": r["text"], "entities": r["entities"]} for r in chosen])
            encoded = [ex.encode(r.text) for r in labelled]
            # (float16 between them, as the recorded run kept them on disk between its two stages)
            states = [tuple(t.half().float() for t in s) for s in ex.states_encoded(encoded, LAYERS)]
            parts[intent, name] = (states, [ex.layout.text_offsets(e) for e in encoded],
                                   [r.spans for r in labelled], [e.text for e in encoded], slots)
    return parts


def _words(offsets, text):
    out = []
    for a, _ in offsets:
        if a < 0:
            out.append(None)
            continue
        s, e = a, a
        while s > 0 and not text[s - 1].isspace():
            s -= 1
        while e < len(text) and not text[e].isspace():
            e += 1
        out.append(text[s:e].lower())
    return out


def _lexical(offsets, text):
    w = _words(offsets, text)
    feats = []
    for i, x in enumerate(w):
        prev = w[i - 1] if i > 0 and w[i - 1] else "<s>"
        nxt = w[i + 1] if i + 1 < len(w) and w[i + 1] else "</s>"
        x = x or "<none>"
        feats.append([f"w={x}", f"p={prev}", f"n={nxt}", f"pw={prev}|{x}", f"wn={x}|{nxt}"])
    return feats


def _mlp(x, y, size, hidden, weight_decay, dropout):
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Dropout(dropout), torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(),
                              torch.nn.Dropout(dropout), torch.nn.Linear(hidden, size))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=weight_decay)
    features, targets = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    for _ in range(15):
        order = torch.randperm(len(features))
        for i in range(0, len(features), 256):
            b = order[i:i + 256]
            loss = torch.nn.functional.cross_entropy(net(features[b]), targets[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    net.eval()

    def log_probs(z):
        with torch.no_grad():
            return torch.log_softmax(net(torch.tensor(z, dtype=torch.float32)), -1).numpy()
    return log_probs


def run(fit_rows: int = 1500, check_rows: int = 300, seed: int = 0) -> dict:
    import scipy.sparse as sp
    from sklearn.feature_extraction import FeatureHasher
    from sklearn.linear_model import LogisticRegression

    from beam_prefix.engines.tagger_fitting import entity_counts, token_data
    from beam_prefix.tasks.span_tags import TagSet, tag_transitions

    hasher = FeatureHasher(n_features=2 ** 16, input_type="string", alternate_sign=False)
    parts = _states(fit_rows, check_rows, seed)
    variants = [(layers, "linear C 0.1") for layers in ((12,), (18,), (12, 18))]
    variants += [(layers, "linear C 0.1 + words") for layers in ((12,), (12, 18))]
    variants += [(layers, reader) for layers in ((18,), (12, 18))
                 for reader in ("mlp 256, dropout 0.3, wd 1e-2", "mlp 512, dropout 0.5, wd 1e-3")]
    totals: dict = {}
    for intent in sorted({k[0] for k in parts}):
        fs, fo, fsp, ft, slots = parts[intent, "fit"]
        cs, co, csp, ct, _ = parts[intent, "check"]
        tags = TagSet(tuple(slots))
        for layers, reader in variants:
            fd = token_data(tags, fs, fo, fsp, list(LAYERS), layers, WINDOW)
            cd = token_data(tags, cs, co, csp, list(LAYERS), layers, WINDOW)
            x = np.concatenate([d[0][d[2]] for d in fd])
            y = np.concatenate([d[1][d[2]] for d in fd])
            mean, std = x.mean(0), x.std(0)
            std[std < 1e-6] = 1
            learned = tag_transitions([d[1][d[2]] for d in fd], tags.size)
            words = "words" in reader

            def features(z, offsets, text):
                z = (z - mean) / std
                return sp.hstack([sp.csr_matrix(z), hasher.transform(_lexical(offsets, text))]).tocsr() if words else z
            if reader.startswith("mlp"):
                hidden, dropout, wd = int(reader.split()[1].rstrip(",")), float(reader.split()[3].rstrip(",")), \
                    float(reader.split()[5])
                log_probs = _mlp((x - mean) / std, y, tags.size, hidden, wd, dropout)
            else:
                fit_x = sp.vstack([hasher.transform(_lexical(o, t))[d[2]] for d, o, t in zip(fd, fo, ft)]) if words \
                    else None
                model = LogisticRegression(C=0.1, max_iter=1000).fit(
                    sp.hstack([sp.csr_matrix((x - mean) / std), fit_x]).tocsr() if words else (x - mean) / std, y)

                def log_probs(z, model=model):
                    out = np.full((z.shape[0], tags.size), -1e9)
                    with np.errstate(divide="ignore"):
                        out[:, model.classes_] = model.predict_log_proba(z)
                    return out
            for w in (0.0, 0.5, 1.0):
                counts = np.zeros(3, dtype=int)
                for d, o, spans, text in zip(cd, co, csp, ct):
                    lp = log_probs(features(d[0], o, text))
                    counts += entity_counts(tags, lp, o, d[2], spans, text, w * learned if w else None)
                key = f"layers {list(layers)}, {reader}, transitions x{w}"
                totals[key] = totals.get(key, np.zeros(3, dtype=int)) + counts
    f1 = {k: round(2 * int(c[0]) / max(int(c[1] + c[2]), 1), 4) for k, c in totals.items()}
    report = {"date": datetime.date.today().isoformat(), "machine": _machine(), "fit_rows_per_intent": fit_rows,
              "check_rows_per_intent": check_rows, "seed": seed, "span_f1_on_other_training_rows": f1,
              "command": f"python -m benchmarks.tagger_survey --fit_rows {fit_rows} --check_rows {check_rows}"}
    lines = [f"# Tagger survey ({report['date']})", "", f"`{report['command']}` on {report['machine']}: span F1 on "
             f"{check_rows} other training rows per intent (SNIPS test rows not read).", "",
             "| tagger | transitions x0 | x0.5 | x1 |", "| --- | --- | --- | --- |"]
    for layers, reader in variants:
        name = f"layers {list(layers)}, {reader}"
        lines.append(f"| {name} | " + " | ".join(f"{f1[f'{name}, transitions x{w}']:.4f}" for w in (0.0, 0.5, 1.0))
                     + " |")
    write_results(RESULTS, "tagger_survey", report, "\n".join(lines) + "\n")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit_rows", type=int, default=1500)
    parser.add_argument("--check_rows", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(run(a.fit_rows, a.check_rows, a.seed)["span_f1_on_other_training_rows"])


if __name__ == "__main__":
    main()
