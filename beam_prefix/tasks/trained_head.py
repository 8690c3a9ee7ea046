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
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

import torch

from beam_prefix.errors import TaskSpecError

__all__ = ["TrainedHead", "text_hash", "feature_fingerprint", "HEAD_METADATA_KEY"]

HEAD_METADATA_KEY = "beam_prefix_head"
_FORMAT = 1


def text_hash(text: str) -> int:
    """A 63-bit hash of a row's (stripped) text: how a head remembers its training rows."""
    digest = hashlib.sha256(text.strip().encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def feature_fingerprint(prompt_fingerprint: str, dtype: torch.dtype | str, layers: Sequence[int]) -> str:
    """What the features depend on: the prompt and model (`prompt_fingerprint`), the
    weights' dtype and the layers read."""
    payload = json.dumps({"prompt": prompt_fingerprint, "dtype": str(dtype).replace("torch.", ""),
                          "layers": list(layers)}, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


class TrainedHead:
    """A fitted head (see the module docstring); read-only once built.

    Args:
        labels: the label names, in the order of `weight`'s rows.
        layers: the hidden-state indices whose last-position states are concatenated.
        weight: ``[K, F]``; bias: ``[K]``; mean, std: ``[F]`` (std > 0).
        fingerprint: `feature_fingerprint` of the prompt, model, dtype and layers.
        train_hashes: `text_hash` of each training row.
        metrics: what fitting measured (k-fold accuracy, per-label F1, ...), JSON-able.
    """

    def __init__(self, *, labels: Sequence[str], layers: Sequence[int], weight: torch.Tensor, bias: torch.Tensor,
                 mean: torch.Tensor, std: torch.Tensor, fingerprint: str, train_hashes: Sequence[int] = (),
                 metrics: dict[str, Any] | None = None, source: str | None = None):
        self.labels = tuple(labels)
        self.layers = tuple(int(i) for i in layers)
        self.weight, self.bias = weight.float(), bias.float()
        self.mean, self.std = mean.float(), std.float()
        if self.weight.shape != (len(self.labels), self.mean.shape[0]) or self.bias.shape != (len(self.labels),) \
                or self.std.shape != self.mean.shape:
            raise TaskSpecError(f"head {source or ''}: weight {tuple(self.weight.shape)}, bias "
                                f"{tuple(self.bias.shape)}, mean {tuple(self.mean.shape)} do not fit "
                                f"{len(self.labels)} labels")
        self.fingerprint = fingerprint
        self.train_hashes = frozenset(int(h) for h in train_hashes)
        self.metrics = dict(metrics or {})
        self.source = source
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
        h.update(json.dumps([self.labels, self.layers, self.fingerprint]).encode("utf-8"))
        return h.hexdigest()[:16]

    def __repr__(self) -> str:  # short: tasks holding a head print (and are keyed) by it
        return f"TrainedHead({self.identity}, {len(self.labels)} labels, layers {list(self.layers)})"

    __str__ = __repr__

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, F]`` features -> ``[B, K]`` logits (fp32, on the features' device)."""
        weight, bias, mean, std = self._tensors(features.device)
        return ((features.float() - mean) / std) @ weight.T + bias

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._on:  # copied once per device; a race only copies twice
            self._on[device] = tuple(t.to(device) for t in (self.weight, self.bias, self.mean, self.std))
        return self._on[device]

    def __getstate__(self):  # pickled to workers without its per-device copies
        return {**self.__dict__, "_on": {}}

    def trained_on(self, text: str) -> bool:
        """Whether a row with this text was one of the head's training rows."""
        return text_hash(text) in self.train_hashes

    def check(self, labels: Sequence[str], fingerprint: str, *, task: str, model: str) -> None:
        """Refuse a head fit for other labels, or on another prompt, model, dtype or layers.

        Raises:
            TaskSpecError: naming the head's and the task's.
        """
        where = f"head {self.source or self.identity}"
        if tuple(labels) != self.labels:
            raise TaskSpecError(f"{where} was fit for labels {list(self.labels)[:8]}... ({len(self.labels)}), "
                                f"task {task!r} has {list(labels)[:8]}... ({len(labels)})")
        if fingerprint != self.fingerprint:
            raise TaskSpecError(f"{where} was fit on features {self.fingerprint}, task {task!r} on model {model} "
                                f"gives features {fingerprint} (another prompt, model, dtype or layers): fit the head "
                                f"again for this task and model (python -m pipelines.fit)")

    # -- the file ---------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        meta = {"format": _FORMAT, "labels": list(self.labels), "layers": list(self.layers),
                "fingerprint": self.fingerprint, "metrics": self.metrics}
        hashes = torch.tensor(sorted(self.train_hashes), dtype=torch.int64, device="cpu")
        save_file({"weight": self.weight.contiguous(), "bias": self.bias.contiguous(), "mean": self.mean.contiguous(),
                   "std": self.std.contiguous(), "train_hashes": hashes}, os.fspath(path),
                  metadata={HEAD_METADATA_KEY: json.dumps(meta, sort_keys=True)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainedHead":
        """Read a head file.

        Raises:
            TaskSpecError: the file cannot be read or is not a head, naming it.
        """
        from safetensors import safe_open

        path = os.fspath(path)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                meta = json.loads((f.metadata() or {})[HEAD_METADATA_KEY])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except FileNotFoundError:
            raise TaskSpecError(f"head file {path!r} does not exist (fit one with python -m pipelines.fit)") from None
        except Exception as e:  # noqa: BLE001 - not safetensors, no metadata, bad JSON...
            raise TaskSpecError(f"head file {path!r} is not a beam-prefix head: {type(e).__name__}: {e}") from None
        if meta.get("format") != _FORMAT:
            raise TaskSpecError(f"head file {path!r} has format {meta.get('format')!r}, this version reads {_FORMAT}")
        return cls(labels=meta["labels"], layers=meta["layers"], weight=tensors["weight"], bias=tensors["bias"],
                   mean=tensors["mean"], std=tensors["std"], fingerprint=meta["fingerprint"],
                   train_hashes=tensors["train_hashes"].tolist(), metrics=meta.get("metrics"), source=path)
