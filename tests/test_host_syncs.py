"""Per-batch host work (#36): the number of device-to-host copies and host synchronisations
in a classification call does not grow with the batch's row count (on a GPU each is a
stall; here they are counted on the CPU: Python-side `.tolist()`/`.item()` calls and the
torch profiler's `aten::item`, `aten::_local_scalar_dense` and `aten::nonzero` ops)."""

from __future__ import annotations

import collections

import pytest
import torch

from beam_prefix import PrefixClassifier

from conftest import TEXTS, tiny_task

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def _syncs(call, monkeypatch) -> collections.Counter:
    counts = collections.Counter()
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            counts[f"Tensor.{_name}"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    monkeypatch.undo()
    for event in prof.key_averages():
        if event.key in SYNC_OPS:
            counts[event.key] += event.count
    return counts


@pytest.mark.parametrize("mode", ["first_token", "head"])
def test_host_syncs_per_batch_do_not_grow_with_its_rows(tiny_models, monkeypatch, mode):
    loaded = tiny_models["llama"]
    task = tiny_task(calibration=True)
    if mode == "head":
        from beam_prefix import fit_head

        base = PrefixClassifier(task=tiny_task(), loaded=loaded, verify=False)
        head = fit_head(base, TEXTS[:12], ["billing", "technical", "account"] * 4, folds=2, lexical=False)
        task = tiny_task().replace(scoring="head", head=head)
    clf = PrefixClassifier(task=task, loaded=loaded, verify=False, batch_size=32)
    assert clf.mode == mode
    texts = (TEXTS * 4)[:32]
    clf.classify(texts[:4])  # warm
    few = _syncs(lambda: clf.classify(texts[:4]), monkeypatch)
    many = _syncs(lambda: clf.classify(texts[:32]), monkeypatch)
    assert few["Tensor.tolist"] >= 1  # the one copy of the batch's scores (the count is real)
    assert many == few, (few, many)
