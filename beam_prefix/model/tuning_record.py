"""What a tuned model directory was made from: its `TuningRecord` (`model_tuning` writes it).

A model directory tuned by `beam_prefix.engines.model_tuning` holds, beside its weights and
tokenizer, `TUNING_FILE`: the base model, the task and rows it was tuned on, the settings,
and the n-gram weight the base model's folds chose. Its `id` is the directory's model id
(`loading.model_id`), so a head's fingerprint names the tuning, not the path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

__all__ = ["TUNING_FILE", "LABELS_PER_BATCH", "TuningRecord", "read_record"]

TUNING_FILE = "beam_prefix_tuning.json"
# labels in a tuning batch by default, and the value of every record written before the
# setting was recorded (so such records read as it, and their ids leave it out)
LABELS_PER_BATCH = 16


@dataclasses.dataclass(frozen=True)
class TuningRecord:
    """What a tuned model directory was made from and how (written as `TUNING_FILE`).

    Attributes:
        base_model: the model id tuned (`loading.model_id`).
        task: the task name whose prompt the rows were read in.
        prompt_fingerprint: the base model's prompt fingerprint for that task.
        layers, pooling: the features trained (as a head reads them).
        tuned_layers: decoder layers changed (the first ones).
        rows: training rows; rows_digest: hash of their texts and labels.
        epochs, learning_rate, temperature, seed, labels_per_batch: the training settings
            (a record from before labels_per_batch existed reads as LABELS_PER_BATCH, what it
            ran with).
        losses: mean loss per epoch.
        base_lexical_alpha: the n-gram weight the base model's folds chose for these rows
            (None: not measured).
        created: when (UTC, ISO 8601); it makes each tuning's id its own.
    """

    base_model: str
    task: str
    prompt_fingerprint: str
    layers: tuple[int, ...]
    pooling: str
    tuned_layers: int
    rows: int
    rows_digest: str
    epochs: int
    learning_rate: float
    temperature: float
    seed: int
    losses: tuple[float, ...]
    base_lexical_alpha: float | None
    created: str
    tune_s: float = 0.0
    labels_per_batch: int = LABELS_PER_BATCH

    @property
    def id(self) -> str:
        """The model id of the tuned directory: the base model's and a digest of this record."""
        data = dataclasses.asdict(self)
        data.pop("tune_s")
        if data["labels_per_batch"] == LABELS_PER_BATCH:  # the only value before the setting: those ids stay
            data.pop("labels_per_batch")
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode("utf-8")).hexdigest()[:16]
        return f"{self.base_model}+tuned-{digest}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self) | {"id": self.id}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> "TuningRecord":
        try:
            data = json.loads(text)
            data.pop("id", None)
            record = cls(**{**data, "layers": tuple(data["layers"]), "losses": tuple(data["losses"])})
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{where}: not a tuning record ({e})") from None
        return record


def read_record(directory: str) -> TuningRecord | None:
    """The tuning record of a local model directory, or None when it was not tuned here."""
    path = os.path.join(directory, TUNING_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return TuningRecord.from_json(f.read(), path)
