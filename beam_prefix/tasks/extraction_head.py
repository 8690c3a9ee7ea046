"""`ExtractionHead`: an extraction task's fields read off the cached forward's hidden states.

A task with ``kind: extract`` and ``scoring: head`` answers with a head fit on labelled
rows (`beam_prefix.engines.extraction_fitting`) instead of decoding JSON. The same suffix
pass that every engine runs gives each of the row's tokens its hidden states; from them:

* span fields (``string``, ``number``, ``integer``, ``date``) come from a `SpanTagger`, a
  linear layer on each token's features (its own states and its next tokens', `window`,
  at `layers`, concatenated and standardised) giving its BIO tags' logits
  (`span_tags.TagSet`); the best valid tag path marks at most one span per field, which
  is parsed as the field's type;
* enum and boolean fields come from a `trained_head.TrainedHead` each, on the row's
  pooled features (the classification head; a boolean's labels are ``false`` and
  ``true``).

The file is one safetensors file: the tagger's tensors ``tagger.weight [T, F]``,
``tagger.bias [T]``, ``tagger.mean [F]``, ``tagger.std [F]``; each field head's
``field.<name>.weight`` (and bias, mean, std); ``train_hashes [N]``; and under the
metadata key ``beam_prefix_extraction_head`` a JSON object: the fields it was fit for
(name, type, enum values), the tagger's fields, layers and window, each field head's
labels, layers and pooling, the feature fingerprint (prompt, model, dtype), the dtype,
and what fitting measured. A head is only used with the prompt, model and dtype it was
fit on.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Sequence

import torch

from beam_prefix.errors import TaskSpecError
from beam_prefix.tasks.span_tags import SPAN_TYPES, TagSet
from beam_prefix.tasks.trained_head import (DTYPES, TrainedHead, _check_regular, _copy_remote, feature_fingerprint,
                                            refuse_other_features, text_hash)

__all__ = ["ExtractionHead", "SpanTagger", "EXTRACTION_HEAD_KEY", "field_signature", "window_features"]

EXTRACTION_HEAD_KEY = "beam_prefix_extraction_head"
_FORMAT = 1


def field_signature(fields) -> list[list]:
    """What a head must agree with in a task's fields: name, type and enum values, in order."""
    return [[f.name, f.type, list(f.values)] for f in fields]


def window_features(states: Sequence[torch.Tensor], window: Sequence[int]) -> torch.Tensor:
    """One row's token features ``[N, H * len(states) * len(window)]``: for each of its
    states ``[N, H]`` (a layer's), each token's own joined with those `window` tokens away
    (``-1`` the previous one; zeros past either end of the row's suffix)."""
    parts = []
    for s in states:
        n = s.shape[0]
        for shift in window:
            moved = torch.zeros_like(s)
            if shift >= 0:
                moved[:max(n - shift, 0)] = s[shift:]
            else:
                moved[-shift:] = s[:n + shift]
            parts.append(moved)
    return torch.cat(parts, dim=-1)


class SpanTagger:
    """A linear layer over each token's windowed hidden states, giving its BIO tags' logits.

    Args:
        fields: the span fields it tags (`span_tags.TagSet`'s order).
        layers: hidden-state indices read (as `TrainedHead.layers`).
        window: token offsets whose states are concatenated for a token (``(0, 1)``: its
            own and the next one's; past the row's suffix: zeros).
        weight: ``[T, F]`` with ``F = H * len(layers) * len(window)``; bias ``[T]``; mean,
            std: ``[F]`` (std > 0).
    """

    def __init__(self, *, fields: Sequence[str], layers: Sequence[int], window: Sequence[int], weight: torch.Tensor,
                 bias: torch.Tensor, mean: torch.Tensor, std: torch.Tensor):
        self.tags = TagSet(tuple(fields))
        self.layers, self.window = tuple(int(i) for i in layers), tuple(int(i) for i in window)
        self.weight, self.bias, self.mean, self.std = weight.float(), bias.float(), mean.float(), std.float()
        if self.weight.shape[0] != self.tags.size or self.bias.shape != (self.tags.size,) \
                or self.weight.shape[1] != self.mean.shape[0] or self.std.shape != self.mean.shape:
            raise TaskSpecError(f"span tagger: weight {tuple(self.weight.shape)}, bias {tuple(self.bias.shape)}, mean "
                                f"{tuple(self.mean.shape)} do not fit {self.tags.size} tags")
        for name, t in (("weight", self.weight), ("bias", self.bias), ("mean", self.mean), ("std", self.std)):
            if not bool(torch.isfinite(t).all()):
                raise TaskSpecError(f"span tagger: {name} holds values that are not finite; fit the head again")
        if not bool((self.std > 0).all()):
            raise TaskSpecError("span tagger: std holds values <= 0; fit the head again")
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def features(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """One row's token features ``[N, F]`` from its states at `layers`, ``[N, H]`` each."""
        return window_features(states, self.window)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, F]`` token features -> ``[N, T]`` tag logits (fp32)."""
        if features.device not in self._on:
            self._on[features.device] = tuple(t.to(features.device) for t in (self.weight, self.bias, self.mean, self.std))
        weight, bias, mean, std = self._on[features.device]
        return ((features.float() - mean) / std) @ weight.T + bias

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": self.bias, "mean": self.mean, "std": self.std}

    def __getstate__(self):
        return {**self.__dict__, "_on": {}}


class ExtractionHead:
    """A fitted extraction head (see the module docstring); read-only once built.

    Args:
        fields: `field_signature` of the task it was fit for.
        tagger: the span fields' tagger (None when the task has no span field).
        field_heads: each enum and boolean field's `TrainedHead`, by name.
        fingerprint: `trained_head.feature_fingerprint` of the prompt, model and dtype (no
            layers: each part records its own).
        train_hashes: `trained_head.text_hash` of each training row.
        metrics: what fitting measured, JSON-able.
        dtype: the `load_model` dtype its features came from.
    """

    def __init__(self, *, fields: Sequence[Sequence], tagger: SpanTagger | None, field_heads: Mapping[str, TrainedHead],
                 fingerprint: str, train_hashes: Sequence[int] = (), metrics: dict[str, Any] | None = None,
                 dtype: str | None = None, source: str | None = None):
        self.fields = [[str(n), str(t), list(v)] for n, t, v in fields]
        self.tagger = tagger
        self.field_heads = dict(field_heads)
        self.fingerprint = fingerprint
        self.train_hashes = frozenset(int(h) for h in train_hashes)
        self.metrics = dict(metrics or {})
        self.source = source
        where = f"extraction head {source!r}" if source else "extraction head"
        if dtype is not None and dtype not in DTYPES:
            raise TaskSpecError(f"{where}: dtype must be one of {DTYPES}, got {dtype!r}")
        self.dtype = dtype
        spans = [n for n, t, _ in self.fields if t in SPAN_TYPES]
        chosen = [n for n, t, _ in self.fields if t not in SPAN_TYPES]
        if spans and (tagger is None or list(tagger.tags.fields) != spans):
            raise TaskSpecError(f"{where}: its tagger answers {None if tagger is None else list(tagger.tags.fields)}, "
                                f"its span fields are {spans}")
        if sorted(self.field_heads) != sorted(chosen):
            raise TaskSpecError(f"{where}: it has heads for {sorted(self.field_heads)}, its enum and boolean fields "
                                f"are {sorted(chosen)}")
        for name, kind, values in self.fields:  # a head answers only values its field has
            allowed = ["false", "true"] if kind == "boolean" else values
            if name in self.field_heads and not set(self.field_heads[name].labels) <= set(allowed):
                raise TaskSpecError(f"{where}: field {name!r}'s head answers {list(self.field_heads[name].labels)}, "
                                    f"the field allows {allowed}")

    @property
    def layers(self) -> tuple[int, ...]:
        """Every hidden-state index a part reads, sorted (what one forward must return)."""
        wanted = set(self.tagger.layers if self.tagger else ())
        for head in self.field_heads.values():
            wanted.update(head.layers)
        return tuple(sorted(wanted))

    @property
    def identity(self) -> str:
        """A hash of everything that shapes the head's answers (in its rows' fingerprint)."""
        h = hashlib.sha256(json.dumps([self.fields, self.fingerprint]).encode("utf-8"))
        if self.tagger is not None:
            h.update(json.dumps([self.tagger.layers, self.tagger.window]).encode("utf-8"))
            for t in self.tagger.tensors().values():
                h.update(t.contiguous().numpy().tobytes())
        for name in sorted(self.field_heads):
            h.update(f"{name}:{self.field_heads[name].identity}".encode("utf-8"))
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        return f"ExtractionHead({self.identity}, {len(self.fields)} fields)"

    __str__ = __repr__

    def part_fingerprint(self, layers: Sequence[int], pooling: str = "last") -> str:
        """The feature fingerprint a part reading `layers` records (a field head's)."""
        return feature_fingerprint(self.fingerprint, self.dtype or "float32", layers, pooling)

    def trained_on(self, text: str) -> bool:
        """Whether a row with this text was one of the head's training rows."""
        return isinstance(text, str) and text_hash(text) in self.train_hashes

    def check(self, fields, fingerprint: str, *, task: str, model: str) -> None:
        """Refuse a head fit for other fields, or on another prompt, model or dtype.

        Raises:
            TaskSpecError: naming the head's and the task's.
        """
        where = f"extraction head {self.source or self.identity}"
        if field_signature(fields) != self.fields:
            raise TaskSpecError(f"{where} was fit for fields {self.fields}, task {task!r} has "
                                f"{field_signature(fields)}: fit it again for this task")
        refuse_other_features(where, self.fingerprint, fingerprint, task=task, model=model,
                              differs="another prompt, model or dtype")

    # -- the file ---------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        meta: dict = {"format": _FORMAT, "fields": self.fields, "fingerprint": self.fingerprint,
                      "metrics": self.metrics, "field_heads": {}}
        if self.dtype is not None:
            meta["dtype"] = self.dtype
        tensors = {"train_hashes": torch.tensor(sorted(self.train_hashes), dtype=torch.int64)}
        if self.tagger is not None:
            meta["tagger"] = {"fields": list(self.tagger.tags.fields), "layers": list(self.tagger.layers),
                              "window": list(self.tagger.window)}
            tensors.update({f"tagger.{k}": t.contiguous() for k, t in self.tagger.tensors().items()})
        for name, head in self.field_heads.items():
            meta["field_heads"][name] = {"labels": list(head.labels), "layers": list(head.layers),
                                         "pooling": head.pooling, "fingerprint": head.fingerprint,
                                         "metrics": head.metrics}
            tensors.update({f"field.{name}.{k}": getattr(head, k).contiguous() for k in ("weight", "bias", "mean", "std")})
        save_file(tensors, os.fspath(path), metadata={EXTRACTION_HEAD_KEY: json.dumps(meta, sort_keys=True)})
        os.chmod(path, 0o644)  # read by other users and workers, as a classification head

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ExtractionHead":
        """Read an extraction head file (a local path or a Beam FileSystem's, e.g. gs://).

        Raises:
            TaskSpecError: the file cannot be read or is not an extraction head, naming it.
        """
        from safetensors import safe_open

        path = os.fspath(path)
        if "://" in path:
            import tempfile

            with tempfile.TemporaryDirectory() as local:
                head = cls.load(_copy_remote(path, os.path.join(local, "head")))
            head.source = path
            return head
        _check_regular(path)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                meta = json.loads((f.metadata() or {})[EXTRACTION_HEAD_KEY])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # noqa: BLE001 - not safetensors, no metadata, bad JSON...
            raise TaskSpecError(f"head file {path!r} is not a beam-prefix extraction head: {type(e).__name__}: {e}") \
                from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise TaskSpecError(f"head file {path!r} has format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                                f"this version reads {_FORMAT}")
        try:
            tagger = None
            if "tagger" in meta:
                t = meta["tagger"]
                tagger = SpanTagger(fields=t["fields"], layers=t["layers"], window=t["window"],
                                    **{k: tensors[f"tagger.{k}"] for k in ("weight", "bias", "mean", "std")})
            heads = {name: TrainedHead(labels=h["labels"], layers=h["layers"], pooling=h["pooling"],
                                       fingerprint=h["fingerprint"], metrics=h.get("metrics"), dtype=meta.get("dtype"),
                                       source=f"{path} field {name}",
                                       **{k: tensors[f"field.{name}.{k}"] for k in ("weight", "bias", "mean", "std")})
                     for name, h in meta["field_heads"].items()}
            return cls(fields=meta["fields"], tagger=tagger, field_heads=heads, fingerprint=meta["fingerprint"],
                       train_hashes=tensors["train_hashes"].tolist(), metrics=meta.get("metrics"),
                       dtype=meta.get("dtype"), source=path)
        except (KeyError, TypeError, ValueError) as e:
            raise TaskSpecError(f"head file {path!r} is damaged: {type(e).__name__}: {e}") from None

