"""Tuning the model itself on labelled rows, so that the states a head reads separate them.

    record = tune_model(task, texts, labels, layers=(6, 12), output_dir="tuned/")
    loaded = load_model("tuned/")          # a model directory like any other
    head = fit_head(PrefixClassifier(task=task, loaded=loaded), texts, labels, layers=(6, 12),
                    pooling="mean", lexical_alpha=record.base_lexical_alpha)

A trained head reads mean-pooled (or last-position) hidden states of a few layers. On few
rows per label those states separate labels less well than a sentence encoder's (docs/heads.md,
"Trained heads"). `tune_model` changes the decoder layers up to the deepest one the head
reads (embeddings and later layers unchanged, so early exit still stops there) with a
supervised contrastive loss (Khosla et al. 2020) on exactly the features the head reads:
each read layer's pooled suffix states, L2-normalised and concatenated. Each batch holds a
few rows of each of several labels.

Each step runs the engine's own forward (`model.forward.forward` on the expanded working
cache, `label_scorers.pool`) with gradients, over a prefix computed with the step's current
weights and no gradient (its keys and values are constants of the step). So it trains what
the engine computes, and nothing of the training path is a second forward.

The result is a model directory (safetensors, the tokenizer, and `TUNING_FILE`, the
`tuning_record.TuningRecord`) that loads as any local model: the prefix cache, its start-up self-check
(cached == full re-encoding) and the fingerprints are built from it as from any other. Its
model id (`loading.model_id`) is the record's id, so heads fit on the base model are refused
on it and heads fit on it are refused elsewhere, however its path is spelled.

A head fit after tuning on the same rows cannot choose its n-gram weight by folds: the
tuned states have seen every fold's held-out rows, so they look better than they are and
the folds weigh the n-grams too little. The record carries the weight the base model's
folds chose (`base_lexical_alpha`), for `fit_head(lexical_alpha=...)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from beam_prefix.errors import TaskSpecError
from beam_prefix.model.tuning_record import LABELS_PER_BATCH, TUNING_FILE, TuningRecord, files_digest, weights_digest

__all__ = ["tune_model", "check_settings", "contrastive_loss", "label_batches", "train_features", "tuned_modules"]

def contrastive_loss(z: torch.Tensor, y: torch.Tensor, temperature: float) -> torch.Tensor:
    """Supervised contrastive loss of unit rows `z` ``[B, F]`` with labels `y` ``[B]``: each
    row's log-probability of its same-label rows among all others, averaged."""
    eye = torch.eye(len(y), dtype=torch.bool, device=z.device)
    sim = (z @ z.T / temperature).masked_fill(eye, float("-inf"))
    logp = sim - torch.logsumexp(sim, 1, keepdim=True)
    same = (y[:, None] == y[None, :]) & ~eye
    return -(logp.masked_fill(~same, 0).sum(1) / same.sum(1).clamp(min=1)).mean()


def label_batches(rows: Sequence[tuple[int, int]], rng: random.Random, *, per_label: int = 4,
                  labels_per_batch: int = LABELS_PER_BATCH) -> list[list[tuple[int, int]]]:
    """One epoch's batches of ``(row, label)`` pairs: each label's rows shuffled and cut in
    chunks of `per_label` (a chunk needs two rows: a positive pair), chunks shuffled and each
    put in the first batch that lacks its label and has room, so batches hold
    `labels_per_batch` distinct labels (fewer only where the rows run out); batches shuffled."""
    by: dict[int, list[int]] = {}
    for row, label in rows:
        by.setdefault(label, []).append(row)
    chunks = []
    for label, members in by.items():
        shuffled = rng.sample(members, len(members))
        chunks += [(label, shuffled[i:i + per_label]) for i in range(0, len(shuffled), per_label)]
    chunks = [c for c in chunks if len(c[1]) >= 2]
    rng.shuffle(chunks)
    # first fit: a chunk whose label the open batch holds waits for a later batch instead of
    # closing it (closing left batches of 6-16 labels, 11.6 on average, when 16 were asked)
    batches: list[list[tuple[int, list[int]]]] = []
    labels: list[set[int]] = []
    for label, members in chunks:
        at = next((i for i, held in enumerate(labels) if label not in held and len(held) < labels_per_batch), None)
        if at is None:
            at = len(batches)
            batches.append([])
            labels.append(set())
        batches[at].append((label, members))
        labels[at].add(label)
    rng.shuffle(batches)
    return [[(r, label) for label, members in b for r in members] for b in batches]


def train_features(model, prefix_ids: Sequence[int], suffixes: Sequence[Sequence[int]], layers: Sequence[int],
                   pooling: str) -> torch.Tensor:
    """The rows' features ``[B, H * len(layers)]`` as a head reads them, each layer's part
    L2-normalised, with gradients to the weights: the engine's forward on the expanded
    working cache, over a prefix computed with the current weights and no gradient."""
    from beam_prefix.engines.label_scorers import pool
    from beam_prefix.model.forward import Step, forward, seated
    from beam_prefix.model.prefix_cache import PrefixCache

    prefix = PrefixCache(model, prefix_ids)
    step = Step.suffixes(suffixes, prefix.length, prefix.device)
    with seated(prefix.working_cache(), len(suffixes)) as cache:
        states = forward(model, prefix, step, cache=cache, layers=tuple(layers))
    return torch.cat([F.normalize(pool((s,), step, pooling), dim=-1) for s in states], -1) / len(layers) ** 0.5


def tuned_modules(model, layers: Sequence[int]) -> tuple[list[torch.nn.Module], int]:
    """The modules a tuning for hidden-state indices `layers` changes, and how many decoder
    layers they hold: the decoder layers up to the deepest one read; when the final
    normalised state is read, every decoder layer and the base model's other modules with
    weights (its final norm), never the embeddings."""
    from beam_prefix.model.early_exit import check_layers, decoder_layers, exit_depth

    base = model.base_model
    decoder = list(decoder_layers(base))
    if max(check_layers(model.config, layers)) == 0:
        raise TaskSpecError(f"layers {list(layers)}: hidden state 0 is the token embeddings, which no decoder "
                            f"layer computes: nothing to tune (read a layer of 1 or more)")
    depth = exit_depth(model.config, layers)
    if depth is not None:
        return decoder[:depth], depth
    others = [m for m in base.children() if not isinstance(m, (torch.nn.ModuleList, torch.nn.Embedding))
              and any(True for _ in m.parameters())]
    return decoder + others, len(decoder)


def check_settings(*, model: str, pooling: str, epochs: int, learning_rate: float, temperature: float,
                   output_dir: str, labels_per_batch: int = LABELS_PER_BATCH) -> None:
    """Refuse, before any model work, what `tune_model` cannot do (ValueError naming it)."""
    if labels_per_batch < 2:
        raise ValueError(f"labels_per_batch must be >= 2 (a batch of one label has no negatives), got "
                         f"{labels_per_batch}")
    if epochs < 1 or learning_rate <= 0 or temperature <= 0:
        raise ValueError(f"epochs >= 1, learning_rate > 0 and temperature > 0 needed, got {epochs}, "
                         f"{learning_rate}, {temperature}")
    if pooling not in ("mean", "last"):
        raise ValueError(f"pooling must be 'mean' or 'last', not {pooling!r}")
    if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise ValueError(f"output_dir={output_dir!r} exists and is not an empty directory; a tuning writes a new one")
    if model.endswith(".gguf"):
        raise ValueError(f"model={model!r}: tune a model directory, 'embedded' or a hub id; a .gguf file's "
                         f"dequantized weights do not save as a model directory")


def tune_model(task, texts: Sequence[str], labels: Sequence[str], *, output_dir: str, model: str = "embedded",
               layers: Sequence[int] = (-1,), pooling: str = "mean", epochs: int = 4, learning_rate: float = 1e-4,
               temperature: float = 0.1, seed: int = 0, base_lexical_alpha: float | None = None,
               labels_per_batch: int = LABELS_PER_BATCH, trust_remote_code: bool = False,
               log: Callable[[str], None] | None = None,
               progress: Callable[[int, int, int, int], None] | None = None) -> TuningRecord:
    """Tune `model` on `texts` and their `labels` (names of `task`'s labels) read in `task`'s
    prompt (a label with a single row joins no batch: a contrastive pair needs two), and write the tuned model directory to `output_dir` (all or nothing: built
    beside it, then renamed; it must not exist, or be empty). A batch holds 4 rows of each of
    `labels_per_batch` labels (more labels: more negatives per step, fewer steps per epoch).
    `log` is called with a line per epoch, `progress` after every step with (epoch, step,
    steps in the epoch, rows in the step), both counted from 1.

    Raises:
        ValueError: bad settings, labels the task lacks, an `output_dir` that holds files.
    """
    from beam_prefix.engines.classifier import PrefixClassifier
    from beam_prefix.engines.head_fitting import check_labels
    from beam_prefix.model.loading import load_model, model_id
    from beam_prefix.tasks.trained_head import text_hash

    texts, labels = list(texts), [str(v) for v in labels]
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
    check_settings(model=model, pooling=pooling, epochs=epochs, learning_rate=learning_rate,
                   temperature=temperature, output_dir=output_dir, labels_per_batch=labels_per_batch)
    task = task.replace(scoring="auto", head=None, calibration=False)
    counts = check_labels(task, labels)
    if max(counts.values()) < 2:
        raise ValueError("no label has two rows: a contrastive tuning needs pairs of rows of one label")
    torch.manual_seed(seed)
    loaded = load_model(model, prepack=False, trust_remote_code=trust_remote_code)  # weights change: no prepacked copies
    clf = PrefixClassifier(task=task, loaded=loaded, verify=False, prefix_attention="expanded")
    suffixes = [clf.encode(t).suffix_ids for t in texts]
    names = list(task.label_names)
    y = [names.index(label) for label in labels]
    net = loaded.model
    for p in net.parameters():
        p.requires_grad_(False)
    modules, depth = tuned_modules(net, layers)
    trained = [p for m in modules for p in m.parameters()]
    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=0.01)
    rng, losses, start = random.Random(seed), [], time.perf_counter()
    net.train(False)  # no dropout: the features are the engine's
    try:
        for epoch in range(epochs):
            epoch_losses = []
            batches = label_batches(list(enumerate(y)), rng, labels_per_batch=labels_per_batch)
            for step, batch in enumerate(batches, 1):
                z = train_features(net, clf.layout.prefix_ids, [suffixes[r] for r, _ in batch], layers, pooling)
                loss = contrastive_loss(z, torch.tensor([label for _, label in batch], device=z.device), temperature)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                epoch_losses.append(float(loss.detach()))
                if progress is not None:
                    progress(epoch + 1, step, len(batches), len(batch))
            losses.append(round(sum(epoch_losses) / len(epoch_losses), 4))
            if log is not None:
                log(f"epoch {epoch + 1}/{epochs}: loss {losses[-1]} ({time.perf_counter() - start:.0f} s)")
    finally:
        for p in trained:
            p.requires_grad_(False)
    digest = hashlib.sha256(json.dumps(sorted([text_hash(t), label] for t, label in zip(texts, labels)))
                            .encode("utf-8")).hexdigest()[:16]
    record = TuningRecord(base_model=model_id(model), task=task.name, prompt_fingerprint=clf.fingerprint,
                          layers=tuple(int(i) for i in layers), pooling=pooling,
                          tuned_layers=depth,
                          rows=len(texts), rows_digest=digest, epochs=epochs, learning_rate=learning_rate,
                          temperature=temperature, seed=seed, labels_per_batch=labels_per_batch,
                          losses=tuple(losses),
                          base_lexical_alpha=base_lexical_alpha,
                          created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          tune_s=round(time.perf_counter() - start, 1))
    return _write(loaded, record, output_dir)


def _write(loaded, record: TuningRecord, output_dir: str) -> TuningRecord:
    """The model, tokenizer and record (with the digest of the weights as saved) into a
    sibling directory, then renamed into place; the record written."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{os.path.basename(os.path.abspath(output_dir))}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        loaded.model.save_pretrained(partial)
        loaded.tokenizer.save_pretrained(partial)
        record = dataclasses.replace(record, weights_digest=weights_digest(partial), files_digest=files_digest(partial))
        with open(os.path.join(partial, TUNING_FILE), "w", encoding="utf-8") as f:
            f.write(record.to_json())
        if os.path.isdir(output_dir):
            os.rmdir(output_dir)  # empty (checked before tuning)
        os.rename(partial, output_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return record
