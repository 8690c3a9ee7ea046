"""`ExtractionHead`: an extraction task's fields read off the cached forward's hidden states.

A task with ``kind: extract`` and ``scoring: head`` answers with a head fit on labelled
rows (`beam_prefix.engines.extraction_fitting`) instead of decoding JSON. The same suffix
pass that every engine runs gives each of the row's tokens its hidden states; from them:

* span fields (``string``, ``number``, ``integer``, ``date``) come from a `SpanTagger`, a
  linear layer (or one hidden layer and a linear one) on each token's features (its own
  states and its neighbours', `window`, at `layers`, concatenated and standardised) giving
  its BIO tags' logits
  (`span_tags.TagSet`); the best valid tag path (with learned scores for one tag
  following another) marks at most one span per field, which is parsed as the field's type;
* enum and boolean fields come from a `trained_head.TrainedHead` each, on the row's
  pooled features (the classification head; a boolean's labels are ``false`` and
  ``true``).

The file is one safetensors file: the tagger's tensors ``tagger.weight [T, D]``,
``tagger.bias [T]``, ``tagger.mean [F]``, ``tagger.std [F]``, ``tagger.transitions [T, T]``
and, with a hidden layer, ``tagger.hidden_weight [D, F]``, ``tagger.hidden_bias [D]``; each
field head's ``field.<name>.weight`` (and bias, mean, std); ``train_hashes [N]``; and under the
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
from beam_prefix.tasks.trained_head import (DTYPES, TrainedHead, _check_regular, _copy_remote, among_rows,
                                            feature_fingerprint, refuse_other_features)

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
    """A token classifier over each token's windowed hidden states, giving its BIO tags' logits:
    a linear layer, or one hidden layer of GELUs before it.

    Args:
        fields: the span fields it tags (`span_tags.TagSet`'s order).
        layers: hidden-state indices read (as `TrainedHead.layers`).
        window: token offsets whose states are concatenated for a token (``(0, 1)``: its
            own and the next one's; past the row's suffix: zeros).
        weight: ``[T, D]``, with ``D = F = H * len(layers) * len(window)`` (linear) or the
            hidden width; bias ``[T]``; mean, std: ``[F]`` (std > 0).
        hidden_weight: ``[D, F]``, the hidden layer's weight (None: a linear tagger).
        hidden_bias: ``[D]``, its bias (None: a linear tagger).
        transitions: ``[T, T]`` scores added where one tag follows another (`best_path`;
            weighted `span_tags.tag_transitions`); default zeros.
    """

    def __init__(self, *, fields: Sequence[str], layers: Sequence[int], window: Sequence[int], weight: torch.Tensor,
                 bias: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, transitions: torch.Tensor | None = None,
                 hidden_weight: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None):
        self.tags = TagSet(tuple(fields))
        self.layers, self.window = tuple(int(i) for i in layers), tuple(int(i) for i in window)
        self.weight, self.bias, self.mean, self.std = weight.float(), bias.float(), mean.float(), std.float()
        size = self.tags.size
        self.transitions = torch.zeros(size, size) if transitions is None else transitions.float()
        if (hidden_weight is None) != (hidden_bias is None):
            raise TaskSpecError("span tagger: a hidden layer needs both hidden_weight and hidden_bias")
        self.hidden = None if hidden_weight is None else (hidden_weight.float(), hidden_bias.float())
        inner = self.mean.shape[0] if self.hidden is None else self.hidden[0].shape[0]
        if self.weight.shape[0] != size or self.bias.shape != (size,) or self.transitions.shape != (size, size) \
                or self.weight.shape[1:] != (inner,) or self.std.shape != self.mean.shape or self.mean.dim() != 1 \
                or (self.hidden is not None and (self.hidden[0].shape[1:] != self.mean.shape
                                                 or self.hidden[1].shape != (inner,))):
            raise TaskSpecError(f"span tagger: shapes {({k: tuple(t.shape) for k, t in self.tensors().items()})} "
                                f"do not fit {size} tags")
        for name, t in self.tensors().items():
            if not bool(torch.isfinite(t).all()):
                raise TaskSpecError(f"span tagger: {name} holds values that are not finite; fit the head again")
        if not bool((self.std > 0).all()):
            raise TaskSpecError("span tagger: std holds values <= 0; fit the head again")
        self._on: dict[torch.device, dict[str, torch.Tensor]] = {}

    def features(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """One row's token features ``[N, F]`` from its states at `layers`, ``[N, H]`` each."""
        return window_features(states, self.window)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, F]`` token features -> ``[N, T]`` tag logits (fp32)."""
        if features.device not in self._on:
            self._on[features.device] = {k: t.to(features.device) for k, t in self.tensors().items()}
        on = self._on[features.device]
        x = (features.float() - on["mean"]) / on["std"]
        if self.hidden is not None:
            x = torch.nn.functional.gelu(x @ on["hidden_weight"].T + on["hidden_bias"])
        return x @ on["weight"].T + on["bias"]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by its name in the file (``tagger.<name>``)."""
        out = {"weight": self.weight, "bias": self.bias, "mean": self.mean, "std": self.std,
               "transitions": self.transitions}
        if self.hidden is not None:
            out.update(hidden_weight=self.hidden[0], hidden_bias=self.hidden[1])
        return out

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

    def trained_on(self, text: str | bytes) -> bool:
        """Whether a row with this text (UTF-8 bytes decoded) was one of the head's training rows."""
        return among_rows(self.train_hashes, text)

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
                                    **{k: tensors.get(f"tagger.{k}") for k in ("transitions", "hidden_weight",
                                                                               "hidden_bias")},  # (optional)
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

