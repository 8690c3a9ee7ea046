"""`TrainedHead`: a linear classifier over the cached forward's hidden states, and its file.

A task with ``scoring: head`` answers with a head instead of asking the language model
how likely each label's tokens are. Each row's *features* are the hidden state(s) at its
last prompt position, the one the model would answer from (`layers`: indices into the
model's hidden states, ``-1`` the final normalised state, optionally one middle layer),
concatenated; the head standardises them with its training rows' mean and deviation and
applies a linear layer; the label probabilities are its softmax. `pipelines.fit` fits one
(multinomial logistic regression) from labelled rows.

The file is one safetensors file: tensors ``weight [K, F]``, ``bias [K]``, ``mean [F]``,
``std [F]`` and ``train_hashes [N]`` (a 63-bit hash of each training text, so a run can
tell which rows a head was fit on and keep them out of any accuracy it reports), and under
the metadata key ``beam_prefix_head`` a JSON object: the labels in order, the layers, the
fingerprint of the task's prompt, model and dtype the features came from, the training
rows, and how well it did in k-fold cross-validation (accuracy, per-label F1, the chosen
regularisation). A head is only used with the prompt and model it was fit on.

A head may also read the row's words (`lexical_head.LexicalHead`: word and character
n-grams, tensors ``lexical_*``, its weight ``lexical_alpha`` in the metadata): its
log-probabilities, times alpha, are added to the hidden-state logits.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from typing import Any, Sequence

import torch

from beam_prefix.errors import TaskSpecError
from beam_prefix.model.half_precision import dtype_of
from beam_prefix.model.loading import precision_of
from beam_prefix.tasks.lexical_head import LexicalHead

__all__ = ["TrainedHead", "text_hash", "feature_fingerprint", "HEAD_METADATA_KEY", "MAX_HEAD_FILE_BYTES", "POOLINGS", "EMBED_POOLINGS", "DTYPES", "dtype_for",
           "refuse_other_features", "among_rows"]

HEAD_METADATA_KEY = "beam_prefix_head"
_FORMAT = 1


def text_hash(text: str) -> int:
    """A 63-bit hash of a row's (stripped) text: how a head remembers its training rows."""
    digest = hashlib.sha256(text.strip().encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def among_rows(train_hashes, text) -> bool:
    """Whether a row with this text (as the engine reads it: UTF-8 bytes decoded) is among
    the training rows whose `text_hash`es are `train_hashes`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return False  # such a row fails; it was not a training row either
    return isinstance(text, str) and text_hash(text) in train_hashes


DTYPES = ("float32", "bfloat16", "float16")  # load_model's dtype names a head may record
POOLINGS = ("last", "mean")  # the row's last suffix position, or the mean over its suffix positions
# what an embedding may pool: a head's poolings, or both at once from one forward ("last+mean":
# the last-position parts of every layer, then the mean parts: what a candidate search reads)
EMBED_POOLINGS = POOLINGS + ("last+mean",)


def feature_fingerprint(prompt_fingerprint: str, dtype: torch.dtype | str, layers: Sequence[int],
                        pooling: str = "last") -> str:
    """What the features depend on: the prompt and model (`prompt_fingerprint`), the
    weights' dtype, the layers read and how positions are pooled (``last`` is left out of
    the hash, so heads fit before pooling existed keep their fingerprint)."""
    data = {"prompt": prompt_fingerprint, "dtype": str(dtype).replace("torch.", ""), "layers": list(layers)}
    if pooling != "last":
        data["pooling"] = pooling
    payload = json.dumps(data, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


# far above any real head (77 labels x 1,152 features is 0.4 MB; 10,000 training hashes 80 kB)
MAX_HEAD_FILE_BYTES = 64 * 1024 * 1024


def _validate(where: str, labels, layers, weight, bias, mean, std) -> None:
    """Refuse a head that would answer NaN or crash mid-run: shapes, labels, layers, finite
    values, a positive deviation.

    Raises:
        TaskSpecError: naming the head and what is wrong.
    """
    if len(labels) < 2 or len(set(labels)) != len(labels) or not all(isinstance(n, str) and n for n in labels):
        raise TaskSpecError(f"{where}: labels must be two or more distinct names, got {list(labels)[:8]}")
    if not layers or len(set(layers)) != len(layers):
        raise TaskSpecError(f"{where}: layers must be distinct hidden-state indices, got {list(layers)}")
    if weight.dim() != 2 or mean.dim() != 1 or weight.shape != (len(labels), mean.shape[0]) \
            or bias.shape != (len(labels),) or std.shape != mean.shape or mean.shape[0] == 0:
        raise TaskSpecError(f"{where}: weight {tuple(weight.shape)}, bias {tuple(bias.shape)}, mean "
                            f"{tuple(mean.shape)}, std {tuple(std.shape)} do not fit {len(labels)} labels")
    for name, t in (("weight", weight), ("bias", bias), ("mean", mean), ("std", std)):
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise TaskSpecError(f"{where}: {bad} of {t.numel()} values of {name} are not finite (NaN or inf); "
                                f"fit the head again (python -m beam_prefix.pipelines.fit)")
    if not bool((std > 0).all()):
        raise TaskSpecError(f"{where}: std holds {int((std <= 0).sum())} values <= 0 (features are divided by it); "
                            f"fit the head again (python -m beam_prefix.pipelines.fit)")


def refuse_other_features(where: str, fit_on: str, given: str, *, task: str, model: str, differs: str) -> None:
    """Refuse a head whose features (`fit_on`, a `feature_fingerprint`) are not the ones the
    task and model give (`given`); `differs`: what may differ, for the message.

    Raises:
        TaskSpecError: naming both fingerprints, the task and the model.
    """
    if given != fit_on:
        raise TaskSpecError(f"{where} was fit on features {fit_on}, task {task!r} on model {model} gives features "
                            f"{given} ({differs}): fit the head again for this task and model "
                            f"(python -m beam_prefix.pipelines.fit)")


def dtype_for(heads, dtype: str | None) -> str:
    """The dtype a step runs in: `dtype` when given, else the one its tasks' heads were fit
    in (``float32`` with none, or heads from before heads recorded it). A head answers only
    in the precision it was fit in, so a given `dtype` that a head's differs from is refused
    here, where the step is built, not on the workers.

    Raises:
        ValueError: naming the head, its dtype and the one given; or heads of two dtypes.
    """
    # a head that records no precision was fit in float32 (every head was, before heads recorded
    # it): checked as float32, so a given bfloat16 is refused here, not by the workers' fingerprint
    recorded = {h.dtype or "float32": h for h in heads if h is not None}
    if dtype is not None:  # its canonical name (``bf16`` is ``bfloat16``), as load_model reads it
        dtype = dtype_of(precision_of(dtype))
    if dtype is None:
        if len(recorded) > 1:
            raise ValueError(f"the tasks' heads were fit in different dtypes {sorted(recorded)}; one step runs "
                             f"one: fit them in one dtype (python -m beam_prefix.pipelines.fit --dtype)")
        return next(iter(recorded), "float32")
    other = [h for d, h in recorded.items() if d != dtype]
    if other:
        h = other[0]
        fit_in = h.dtype or "float32 (it records no precision: a head that does not was fit in float32)"
        raise ValueError(f"dtype={dtype!r}, but head {h.source or h.identity} was fit in {fit_in}, and a head "
                         f"answers only in the precision it was fit in: leave dtype out (it follows the head), or "
                         f"fit a head in {dtype} (python -m beam_prefix.pipelines.fit --dtype {dtype})")
    return dtype


class TrainedHead:
    """A fitted head (see the module docstring); read-only once built.

    Args:
        labels: the label names, in the order of `weight`'s rows.
        layers: the hidden-state indices whose last-position states are concatenated.
        weight: ``[K, F]``; bias: ``[K]``; mean, std: ``[F]`` (std > 0).
        fingerprint: `feature_fingerprint` of the prompt, model, dtype and layers.
        train_hashes: `text_hash` of each training row.
        metrics: what fitting measured (k-fold accuracy, per-label F1, ...), JSON-able.
        dtype: the `load_model` dtype its features came from (``float32``, ``bfloat16``,
            ``float16``; None in files written before heads recorded it): a step given no
            dtype runs in it (`dtype_for`).
    """

    def __init__(self, *, labels: Sequence[str], layers: Sequence[int], weight: torch.Tensor, bias: torch.Tensor,
                 mean: torch.Tensor, std: torch.Tensor, fingerprint: str, train_hashes: Sequence[int] = (),
                 metrics: dict[str, Any] | None = None, source: str | None = None, pooling: str = "last",
                 lexical: LexicalHead | None = None, dtype: str | None = None):
        where = f"head {source!r}" if source else "head"
        self.labels = tuple(labels)
        try:
            self.layers = tuple(operator.index(i) for i in layers)
        except TypeError:
            raise TaskSpecError(f"{where}: layers must be integers, got {list(layers)}") from None
        if pooling not in POOLINGS:
            raise TaskSpecError(f"{where}: pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        self.weight, self.bias = weight.float(), bias.float()
        self.mean, self.std = mean.float(), std.float()
        _validate(where, self.labels, self.layers, self.weight, self.bias, self.mean, self.std)
        self.fingerprint = fingerprint
        self.train_hashes = frozenset(int(h) for h in train_hashes)
        self.metrics = dict(metrics or {})
        self.source = source
        if lexical is not None and lexical.labels != len(self.labels):
            raise TaskSpecError(f"{where}: its lexical part answers {lexical.labels} labels, the head {len(self.labels)}")
        self.lexical = lexical
        if dtype is not None and dtype not in DTYPES:
            raise TaskSpecError(f"{where}: dtype must be one of {DTYPES}, got {dtype!r}")
        self.dtype = dtype
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    @property
    def features(self) -> int:
        """F, the feature vector's length."""
        return int(self.mean.shape[0])

    @property
    def identity(self) -> str:
        """A hash of the head's weights and labels (in the prompt fingerprint of its rows)."""
        h = hashlib.sha256()
        for t in (self.weight, self.bias, self.mean, self.std):
            h.update(t.contiguous().numpy().tobytes())
        h.update(json.dumps([self.labels, self.layers, self.fingerprint]
                            + ([self.pooling] if self.pooling != "last" else [])).encode("utf-8"))
        if self.lexical is not None:
            self.lexical.digest(h)
        return h.hexdigest()[:16]

    def __repr__(self) -> str:  # short: tasks holding a head print (and are keyed) by it
        pooled = "" if self.pooling == "last" else f", {self.pooling} pooling"
        words = "" if self.lexical is None else f", n-grams x {self.lexical.alpha:g}"
        return f"TrainedHead({self.identity}, {len(self.labels)} labels, layers {list(self.layers)}{pooled}{words})"

    __str__ = __repr__

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, F]`` features -> ``[B, K]`` logits (fp32, on the features' device)."""
        weight, bias, mean, std = self._tensors(features.device)
        return ((features.float() - mean) / std) @ weight.T + bias

    def evidence(self, texts: Sequence[str], device: torch.device | str = "cpu") -> torch.Tensor | None:
        """``[B, K]`` what the lexical part adds to `logits` for rows with these texts (the
        texts the engine read), or None for a head without one."""
        if self.lexical is None:
            return None
        return self.lexical.evidence(texts).to(device)

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._on:  # copied once per device; a race only copies twice
            self._on[device] = tuple(t.to(device) for t in (self.weight, self.bias, self.mean, self.std))
        return self._on[device]

    def __getstate__(self):  # pickled to workers without its per-device copies
        return {**self.__dict__, "_on": {}}

    def trained_on(self, text: str | bytes) -> bool:
        """Whether a row with this text (as the engine reads it: UTF-8 bytes decoded) was one
        of the head's training rows."""
        return among_rows(self.train_hashes, text)

    def check(self, labels: Sequence[str], fingerprint: str, *, task: str, model: str) -> None:
        """Refuse a head fit for other labels, or on another prompt, model, dtype or layers.

        Raises:
            TaskSpecError: naming the head's and the task's.
        """
        where = f"head {self.source or self.identity}"
        if tuple(labels) != self.labels:
            raise TaskSpecError(f"{where} was fit for labels {list(self.labels)[:8]}... ({len(self.labels)}), "
                                f"task {task!r} has {list(labels)[:8]}... ({len(labels)})")
        refuse_other_features(where, self.fingerprint, fingerprint, task=task, model=model,
                              differs="another prompt, model, dtype or layers")

    # -- the file ---------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        meta = {"format": _FORMAT, "labels": list(self.labels), "layers": list(self.layers),
                "fingerprint": self.fingerprint, "metrics": self.metrics}
        if self.pooling != "last":  # (absent: last, as in files written before pooling existed)
            meta["pooling"] = self.pooling
        if self.dtype is not None:
            meta["dtype"] = self.dtype
        tensors = {}
        if self.lexical is not None:
            meta["lexical_alpha"] = self.lexical.alpha
            tensors = {k: t.contiguous() for k, t in self.lexical.tensors().items()}
        hashes = torch.tensor(sorted(self.train_hashes), dtype=torch.int64, device="cpu")
        save_file({"weight": self.weight.contiguous(), "bias": self.bias.contiguous(), "mean": self.mean.contiguous(),
                   "std": self.std.contiguous(), "train_hashes": hashes, **tensors}, os.fspath(path),
                  metadata={HEAD_METADATA_KEY: json.dumps(meta, sort_keys=True)})
        os.chmod(path, 0o644)  # (safetensors writes 0600) a head is read by other users and workers: as fit's

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainedHead":
        """Read a head file.

        Raises:
            TaskSpecError: the file cannot be read or is not a head, naming it.
        """
        from safetensors import safe_open

        path = os.fspath(path)
        if "://" in path:  # gs:// or another Beam FileSystem: a local copy, read the same way
            import tempfile

            with tempfile.TemporaryDirectory() as local:
                head = cls.load(_copy_remote(path, os.path.join(local, "head")))
            head.source = path
            return head
        _check_regular(path)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                meta = json.loads((f.metadata() or {})[HEAD_METADATA_KEY])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # noqa: BLE001 - not safetensors, no metadata, bad JSON...
            raise TaskSpecError(f"head file {path!r} is not a beam-prefix head: {type(e).__name__}: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else None
            raise TaskSpecError(f"head file {path!r} has format {got!r}, this version reads {_FORMAT}")
        missing = [k for k in ("labels", "layers", "fingerprint") if k not in meta] + \
            [k for k in ("weight", "bias", "mean", "std", "train_hashes") if k not in tensors]
        if missing:
            raise TaskSpecError(f"head file {path!r} is damaged: it lacks {missing}")
        if not isinstance(meta["labels"], list) or not isinstance(meta["layers"], list) \
                or not isinstance(meta["fingerprint"], str):
            raise TaskSpecError(f"head file {path!r} is damaged: labels, layers or fingerprint of the wrong type")
        lexical = None
        if "lexical_alpha" in meta:
            alpha = meta["lexical_alpha"]
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
                raise TaskSpecError(f"head file {path!r} is damaged: lexical_alpha {alpha!r} is not a number")
            lexical = LexicalHead.from_tensors(tensors, alpha, where=f"head file {path!r}")
        hashes = tensors["train_hashes"]
        if hashes.dtype != torch.int64 or hashes.dim() != 1:  # (float64 rounds 63-bit hashes: rows not recognised)
            raise TaskSpecError(f"head file {path!r} is damaged: train_hashes must be a 1-D int64 tensor, got a "
                                f"{hashes.dim()}-D {str(hashes.dtype).removeprefix('torch.')} one")
        return cls(labels=meta["labels"], layers=meta["layers"], weight=tensors["weight"], bias=tensors["bias"],
                   mean=tensors["mean"], std=tensors["std"], fingerprint=meta["fingerprint"],
                   train_hashes=hashes.tolist(), metrics=meta.get("metrics"), source=path,
                   pooling=meta.get("pooling", "last"), lexical=lexical, dtype=meta.get("dtype"))


def _copy_remote(url: str, target: str) -> str:
    """Copy a head file from a Beam FileSystem to `target`, refusing one too large."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    try:
        found = FileSystems.match([url])[0].metadata_list
    except Exception as e:  # noqa: BLE001 - no such bucket, no credentials...
        raise TaskSpecError(f"head file {url!r} cannot be read: {type(e).__name__}: {e}") from None
    if not found:
        raise TaskSpecError(f"head file {url!r} does not exist (fit one with python -m beam_prefix.pipelines.fit)")
    if found[0].size_in_bytes > MAX_HEAD_FILE_BYTES:
        raise TaskSpecError(f"head file {url!r} is {found[0].size_in_bytes / 2**20:.0f} MB; a head file is at "
                            f"most {MAX_HEAD_FILE_BYTES // 2**20} MB")
    with FileSystems.open(url, compression_type=CompressionTypes.UNCOMPRESSED) as src, open(target, "wb") as out:
        out.write(src.read(MAX_HEAD_FILE_BYTES + 1))
    return target


def _check_regular(path: str) -> None:
    """Only a regular file of a head's size is read: a FIFO would hang the launcher, a huge
    file exhaust its memory."""
    import stat

    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise TaskSpecError(f"head file {path!r} does not exist (fit one with python -m beam_prefix.pipelines.fit)") from None
    except OSError as e:
        raise TaskSpecError(f"head file {path!r} cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        raise TaskSpecError(f"head file {path!r} is not a regular file")
    if info.st_size > MAX_HEAD_FILE_BYTES:
        raise TaskSpecError(f"head file {path!r} is {info.st_size / 2**20:.0f} MB; a head file is at most "
                            f"{MAX_HEAD_FILE_BYTES // 2**20} MB")
