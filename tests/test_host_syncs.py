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


def _syncs(call) -> collections.Counter:
    counts = collections.Counter()
    with pytest.MonkeyPatch.context() as patch:  # undone on return; the test's own patches stay
        for name in ("tolist", "item"):
            original = getattr(torch.Tensor, name)

            def counted(self, *a, _name=name, _original=original, **k):
                counts[f"Tensor.{_name}"] += 1
                return _original(self, *a, **k)

            patch.setattr(torch.Tensor, name, counted)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
    for event in prof.key_averages():
        if event.key in SYNC_OPS:
            counts[event.key] += event.count
    return counts


@pytest.mark.parametrize("mode", ["first_token", "head"])
def test_host_syncs_per_batch_do_not_grow_with_its_rows(tiny_models, mode):
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
    few = _syncs(lambda: clf.classify(texts[:4]))
    many = _syncs(lambda: clf.classify(texts[:32]))
    assert few["Tensor.tolist"] >= 1  # the one copy of the batch's scores (the count is real)
    assert many == few, (few, many)


def test_pruned_search_syncs_per_round_do_not_grow_with_its_rows(tiny_models, monkeypatch):
    """Each round of the search decides on the host which nodes run next (a few syncs per
    round, whatever the row count); a batch runs as many rounds as its slowest row."""
    from test_label_search import HARD_LABELS

    from beam_prefix.engines import label_scorers

    clf = PrefixClassifier(task=tiny_task(HARD_LABELS, scoring="sequence"), loaded=tiny_models["llama"],
                           verify=False, batch_size=32, label_search="pruned")
    assert clf.label_search == "pruned"
    texts = (TEXTS * 4)[:32]
    clf.classify(texts[:4])  # warm
    passes = collections.Counter()
    original = label_scorers.forward

    def counted(*args, **kwargs):
        passes["forward"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(label_scorers, "forward", counted)
    per_round: dict[int, tuple] = {}
    for n in (4, 32):
        passes.clear()
        counts = _syncs(lambda: clf.classify(texts[:n]))
        rounds = passes["forward"] - 1  # the suffix pass, then one per round
        assert rounds >= 2  # the search really ran rounds
        per_round[n] = (rounds, dict(counts))
    # the 32 rows (the 4 and their repeats) need the same rounds: the same syncs, not 8x
    assert per_round[4] == per_round[32], per_round


@pytest.mark.parametrize("pick", ["host", "device"])
def test_decoding_syncs_per_step_do_not_grow_with_its_rows(tiny_models, monkeypatch, pick):
    """Constrained decoding copies each step's choice to the host once (whatever the row
    count): 16 rows that repeat 4 texts take the same steps and the same syncs as the 4."""
    import functools

    from beam_prefix.engines import decoding
    from test_extraction import _extractor, extract_task

    monkeypatch.setattr("beam_prefix.engines.extractor.decode_cached",
                        functools.partial(decoding.decode_cached, pick=pick))
    ex = _extractor(tiny_models["llama"], batch_size=16, task=extract_task(max_new_tokens=24))
    texts = TEXTS[:4] * 4
    ex.extract(texts[:4])  # warm
    few = _syncs(lambda: ex.extract(texts[:4]))
    many = _syncs(lambda: ex.extract(texts))
    steps = max(len(e.tokens) for e in ex.extract(texts[:4]))
    assert few["aten::nonzero"] == steps  # the step's packing: the counts are real
    if pick == "device":
        assert few["Tensor.tolist"] == steps  # the step's tokens: one copy back
    assert many == few, (few, many)
