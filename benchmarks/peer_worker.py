"""One contender process of `benchmarks.peers`: JSON commands on stdin, one JSON answer a line.

Each side (ours, llama.cpp) runs in its own process so that neither's threads, allocator or
library state touches the other's timings; the driver runs them one at a time, in rounds.

Commands: `{"op": "ours", ...}` or `{"op": "llama", ...}` set the process up (see `_ours`
and `_llama`) and answer what the driver needs (token ids, which contenders exist);
`{"op": "run", "name": N}` times contender N on all rows and answers its ms/row and labels;
`{"op": "profile", ...}` answers a per-op profile of our engine; `{"op": "quit"}` ends.
"""

from __future__ import annotations

import json
import sys
import time


# our variants: the model as loaded, and what each of its CPU fast paths buys; (state key, name suffix)
VARIANTS = (("loaded", ""), ("ungrouped", ", siblings not grouped"), ("plain", ", weights not prepacked"))


def _argmax(scores) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


def _ours(cmd: dict) -> tuple[dict, dict]:
    """Our engine at each batch size in `batches` as `load_model` loads it (weights prepacked,
    siblings grouped), with siblings not grouped, and with weights not prepacked; the task
    uncalibrated (argmax of the label tokens' logits, as llama.cpp's contenders read them)."""
    import torch

    from beam_prefix import PrefixClassifier, TaskSpec
    from beam_prefix.model.cpu_linear import unfuse_siblings
    from beam_prefix.model.loading import load_model
    from benchmarks.floor import non_embedding_params

    loaded = load_model(cmd["model"], dtype=cmd.get("dtype", "float32"), threads=cmd["threads"])
    # what grouping siblings buys: the same, each linear computing alone
    ungrouped = load_model(cmd["model"], dtype=cmd.get("dtype", "float32"), threads=cmd["threads"])
    unfuse_siblings(ungrouped.model)
    # what prepacking buys: plain F.linear
    plain = load_model(cmd["model"], dtype=cmd.get("dtype", "float32"), threads=cmd["threads"], prepack=False)
    task = TaskSpec.from_yaml(cmd["task"]).replace(calibration=False)
    texts = cmd["texts"]
    runs, one_row, clf = {}, {}, None
    for batch in cmd["batches"]:
        for model, suffix in VARIANTS:
            model = {"loaded": loaded, "ungrouped": ungrouped, "plain": plain}[model]
            clf = PrefixClassifier(task=task, loaded=model, verify=False, batch_size=batch)
            clf.classify(texts[:batch])  # warm-up
            name = f"C batch {batch}{suffix}"
            runs[name] = (lambda c: lambda: [p.label for p in c.classify(texts)])(clf)
            one_row[name] = batch == 1
    if clf.mode != "first_token":
        raise SystemExit(f"benchmarks.peers compares first-token tasks; {cmd['task']} scores {clf.mode}")
    layout = clf.layout
    encoded = [clf.encode(t) for t in texts]
    info = {"model_id": loaded.model_id, "prefix_ids": list(layout.prefix_ids),
            "suffix_ids": [list(e.suffix_ids) for e in encoded],
            "prompts": [layout.prompt_text(e.text) for e in encoded],
            "label_first_ids": [int(i) for i in clf.scorer.first_ids.tolist()],
            "labels": list(task.label_names),
            "non_embedding_params": non_embedding_params(loaded.model), "threads": torch.get_num_threads(),
            "contenders": one_row}
    state = {"runs": runs, "loaded": loaded, "ungrouped": ungrouped, "plain": plain, "task": task, "texts": texts}
    return info, state


def _llama(cmd: dict) -> tuple[dict, dict]:
    """llama.cpp's contenders on each quantized file: the batched path with flash attention
    on and off, and the one-row path where asked; token ids checked against ours first."""
    from benchmarks import llama_cpp_peer as peer

    prefix, suffixes, labels = cmd["prefix_ids"], cmd["suffix_ids"], cmd["labels"]
    first_ids, batch, threads = cmd["label_first_ids"], cmd["batch"], cmd["threads"]
    max_suffix = max(len(s) for s in suffixes)
    runs, one_row, mismatched = {}, {}, {}
    files = {kind: peer.quantized(cmd["gguf"], kind, cmd["cache_dir"]) for kind in cmd["kinds"]}
    for kind, path in files.items():
        model = peer._Model(path)
        mismatched[kind] = sum(model.tokenize(p) != tuple(prefix) + tuple(s) for p, s in zip(cmd["prompts"], suffixes))
        for fa in (True, False):
            engine = peer.Batched(path, prefix, batch=batch, max_suffix=max_suffix, threads=threads, flash_attn=fa)
            engine.scores(suffixes[:batch], first_ids)  # warm-up
            name = f"L {kind} batched {batch}, flash attention {'on' if fa else 'off'}"
            runs[name] = (lambda e: lambda: [labels[_argmax(s)] for s in e.scores(suffixes, first_ids)])(engine)
            one_row[name] = False
        if kind in cmd["one_row"]:
            for fa in (False, True):
                one = peer.OneRow(path, prefix, max_suffix=max_suffix, threads=threads, flash_attn=fa)
                one.scores(suffixes[:2], first_ids)
                name = f"L {kind} one row (Llama, kept prefix), flash attention {'on' if fa else 'off'}"
                runs[name] = (lambda e: lambda: [labels[_argmax(s)] for s in e.scores(suffixes, first_ids)])(one)
                one_row[name] = True
    return {"token_mismatches": mismatched, "contenders": one_row, "files": files}, {"runs": runs}


def _profile(state: dict, cmd: dict) -> dict:
    """Self time of each torch op over one pass of `rows` rows at `batch`."""
    from benchmarks.op_profile import profile_classify

    return dict(profile_classify(state[cmd["variant"]], state["task"], state["texts"][:cmd["rows"]], cmd["batch"],
                                 top=cmd.get("top", 25)), variant=cmd["variant"])


def main() -> None:
    import os

    # answers go to the driver on the original stdout; anything else printed (by Python or C
    # libraries) goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    state: dict = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op in ("ours", "llama"):
            answer, state = (_ours if op == "ours" else _llama)(cmd)
        elif op == "run":
            start = time.perf_counter()
            labels = state["runs"][cmd["name"]]()
            ms = 1e3 * (time.perf_counter() - start) / len(labels)
            answer = {"ms_per_row": ms, "labels": labels}
        elif op == "profile":
            answer = _profile(state, cmd)
        else:
            raise SystemExit(f"unknown op {op!r}")
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
