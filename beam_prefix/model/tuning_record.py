"""What a tuned model directory was made from: its `TuningRecord` (`model_tuning` writes it).

A model directory tuned by `beam_prefix.engines.model_tuning` holds, beside its weights and
tokenizer, `TUNING_FILE`: the base model, the task and rows it was tuned on, the settings,
the n-gram weight the base model's folds chose, and digests of its weight files and of
every other file that changes the forward or the tokens (`FORWARD_FILES`: configuration,
generation configuration, tokenizer). Its `id` is the directory's model id
(`loading.model_id`), so a head's fingerprint names the tuning, not the path, and covers
those files: `check_weights` (called wherever the id is read with the files at hand)
refuses a directory whose files are not the ones the record was written with. The digest is a full SHA-256 of every ``*.safetensors``
file (about 0.35 s for the embedded model's 540 MB), computed once per file version in a
process (keyed by path, size and modification time).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import threading

__all__ = ["TUNING_FILE", "LABELS_PER_BATCH", "FORWARD_FILES", "TuningRecord", "read_record", "weights_digest",
           "files_digest", "check_weights"]

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
        weights_digest: `weights_digest` of the directory's weight files as written.
        files_digest: `files_digest` of its other files that change the forward or the
            tokens (configuration, generation configuration, tokenizer files) as written.
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
    weights_digest: str | None = None  # (None: a record written before digests, not checked)
    files_digest: str | None = None  # `files_digest` (None: a record written before it, not checked)

    @property
    def id(self) -> str:
        """The model id of the tuned directory: the base model's and a digest of this record."""
        data = dataclasses.asdict(self)
        data.pop("tune_s")
        for digest in ("weights_digest", "files_digest"):  # records from before each digest: their ids stay
            if data[digest] is None:
                data.pop(digest)
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


_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> the file's SHA-256
_DIGESTS_LOCK = threading.Lock()


def _file_digest(path: str) -> str:
    info = os.stat(path)
    key = (os.path.realpath(path), info.st_size, info.st_mtime_ns, info.st_ino)
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    with _DIGESTS_LOCK:
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def weights_digest(directory: str) -> str:
    """A digest of the weight files (``*.safetensors``, by name) of a local model directory."""
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors"))):
        h.update(f"{os.path.basename(path)}\0{_file_digest(path)}\0".encode("utf-8"))
    return h.hexdigest()[:32]


# the files of a model directory, beside its weights, that change what the model computes or
# the tokens it reads (a loader reads them): `files_digest` covers every one present, by name
FORWARD_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
                 "vocab.*", "merges.txt", "*.model", "chat_template.*", "*.py", "preprocessor_config.json")


def files_digest(directory: str) -> str:
    """A digest of the `FORWARD_FILES` of a local model directory (names and contents): a
    file added, removed or changed changes it."""
    h = hashlib.sha256()
    names = sorted({os.path.basename(p) for pattern in FORWARD_FILES
                    for p in glob.glob(os.path.join(glob.escape(directory), pattern)) if os.path.isfile(p)})
    for name in names:
        h.update(f"{name}\0{_file_digest(os.path.join(directory, name))}\0".encode("utf-8"))
    return h.hexdigest()[:32]


def check_weights(directory: str, record: TuningRecord) -> None:
    """Refuse a tuned directory whose weight files, configuration or tokenizer files are not
    those its record was written with.

    Raises:
        ValueError: naming the directory and which files changed.
    """
    changed = []
    if record.weights_digest is not None and weights_digest(directory) != record.weights_digest:
        changed.append("weight files")
    if record.files_digest is not None and files_digest(directory) != record.files_digest:
        changed.append(f"configuration or tokenizer files ({', '.join(FORWARD_FILES[:4])}, ...)")
    if changed:
        raise ValueError(f"{directory}: its {' and '.join(changed)} are not the ones its tuning record "
                         f"({TUNING_FILE}) was written with (replaced or changed since the tuning): its model id, "
                         f"and every head fit on it, no longer describe it; tune again, or restore them")
