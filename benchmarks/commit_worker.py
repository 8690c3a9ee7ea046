"""One side of `benchmarks.against_commit`: the engines of one source tree, timed on command.

Run as a script by path (not as a module), with the tree to time as its working directory
and first on PYTHONPATH, so `beam_prefix` is imported from that tree; it uses only what
every version of the package has had (`PrefixClassifier.load`, `classify`, `Extractor.load`,
`extract`). Spoken to as `benchmarks.peers.Worker`: JSON lines on stdin, one answer a line.
``{"op": "load", "model", "task", "threads", "batch", "extract_task"}`` loads the engines
(``extract_task`` None: no extractor); ``{"op": "time", "kind": "classify" | "extract",
"batch": B, "texts": [...]}`` answers ``{"ms_per_row": ..., "answers": [...]}`` (each row's
label, or its generated text); ``{"op": "quit"}`` ends.
"""

from __future__ import annotations

import json
import sys
import time


def _load(settings: dict):
    import torch

    torch.set_num_threads(settings["threads"])
    from beam_prefix import Extractor, PrefixClassifier

    clf = PrefixClassifier.load(settings["task"], model=settings["model"], verify=False,
                                batch_size=settings["batch"])
    extractor = None
    if settings.get("extract_task"):
        extractor = Extractor.load(settings["extract_task"], model=settings["model"], verify=False,
                                   batch_size=settings["batch"])
    return clf, extractor


def main() -> None:
    clf = extractor = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        if cmd["op"] == "load":
            clf, extractor = _load(cmd)
            print(json.dumps({"ready": True}), flush=True)
            continue
        texts, batch = cmd["texts"], cmd["batch"]
        start = time.perf_counter()
        if cmd["kind"] == "extract":
            answers = [e.raw_output for e in extractor.extract(texts)]
        elif batch == 1:
            answers = [clf.classify([t])[0].label for t in texts]
        else:
            answers = [p.label for p in clf.classify(texts)]
        print(json.dumps({"ms_per_row": (time.perf_counter() - start) / len(texts) * 1000, "answers": answers}),
              flush=True)


if __name__ == "__main__":
    main()
