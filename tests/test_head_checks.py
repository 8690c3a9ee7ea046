"""A head file is checked when it is read (round 3): non-finite values, a zero deviation,
damaged or missing parts, a FIFO or an oversized file are refused naming the file; a score
that is not a number fails the self-check and the row, never passes as 'max diff 0'."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from beam_prefix import PrefixClassifier, TaskSpecError, VerificationError
from beam_prefix.errors import NonFiniteScoreError
from beam_prefix.tasks.trained_head import HEAD_METADATA_KEY, MAX_HEAD_FILE_BYTES, TrainedHead

from conftest import SUPPORT_TASK, TEXTS

SHIPPED = os.path.join(os.path.dirname(SUPPORT_TASK), "support_tickets.head")


def _rewrite(path, *, drop=(), meta_changes=None, **tensor_changes):
    """A copy of the shipped head with some tensors changed or dropped (bypassing `save`,
    which would refuse them)."""
    with safe_open(SHIPPED, framework="pt") as f:
        meta = json.loads(f.metadata()[HEAD_METADATA_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for name, change in tensor_changes.items():
        tensors[name] = change(tensors[name].clone())
    for name in drop:
        del tensors[name]
    meta.update(meta_changes or {})
    save_file(tensors, str(path), metadata={HEAD_METADATA_KEY: json.dumps(meta)})
    return str(path)


def _set(index, value):
    def change(t):
        t.view(-1)[index] = value
        return t
    return change


@pytest.mark.parametrize("changes,message", [
    (dict(weight=_set(100, math.nan)), "1 of .* values of weight are not finite"),
    (dict(bias=_set(0, math.inf)), "values of bias are not finite"),
    (dict(mean=_set(3, math.nan)), "values of mean are not finite"),
    (dict(std=_set(7, 0.0)), "std holds 1 values <= 0"),
    (dict(weight=lambda t: t[:2]), "do not fit 3 labels"),
    (dict(meta_changes={"layers": [-1, -1]}), "layers must be distinct"),
    (dict(meta_changes={"labels": ["billing", "billing", "account"]}), "two or more distinct names"),
    (dict(drop=("bias",)), r"is damaged: it lacks \['bias'\]"),
    (dict(meta_changes={"fingerprint": None}), "is damaged"),
], ids=["nan-weight", "inf-bias", "nan-mean", "zero-std", "shape", "dup-layers", "dup-labels", "no-bias",
        "bad-meta"])
def test_a_bad_head_file_is_refused_naming_it(tmp_path, changes, message):
    path = _rewrite(tmp_path / "bad.head", **changes)
    with pytest.raises(TaskSpecError, match=message) as e:
        TrainedHead.load(path)
    assert repr(path) in str(e.value)


def test_a_fifo_or_an_oversized_file_is_not_read(tmp_path):
    fifo = tmp_path / "pipe.head"
    os.mkfifo(fifo)
    with pytest.raises(TaskSpecError, match="is not a regular file"):  # (opening it would block for ever)
        TrainedHead.load(fifo)
    big = tmp_path / "big.head"
    with open(big, "wb") as f:
        f.truncate(MAX_HEAD_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(TaskSpecError, match="at most 64 MB"):
        TrainedHead.load(big)
    assert TrainedHead.load(SHIPPED).labels == ("billing", "technical", "account")


def _poisoned(tiny_models):
    """A classifier whose head gives NaN after it was built and checked (e.g. a weight
    corrupted in memory): what the self-check and the rows must catch."""
    from test_head import _features_task, _head_for

    base = PrefixClassifier(task=_features_task(), loaded=tiny_models["llama"], verify=False)
    head = _head_for(base)
    clf = PrefixClassifier(task=base.task.replace(scoring="head", head=head), loaded=tiny_models["llama"],
                           verify=False)
    assert clf.verify() < 1e-4  # a good head passes
    head.weight[0, 0] = math.nan
    head._on.clear()
    return clf


def test_a_nan_score_fails_the_self_check_and_the_row(tiny_models):
    clf = _poisoned(tiny_models)
    with pytest.raises(VerificationError, match="not numbers"):
        clf.verify()
    with pytest.raises(NonFiniteScoreError) as e:
        clf.classify(TEXTS[:2])
    assert e.value.reason == "non_finite_score"


def test_a_nan_score_is_a_failed_row_in_the_beam_step(tiny_dir):
    """Through ClassifyText (self-check off, so the rows meet the NaN): the batch fails,
    each row is retried alone and fails with reason non_finite_score; none is labelled."""
    import apache_beam as beam
    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.util import assert_that, equal_to

    from beam_prefix.transforms import ClassifyText
    from test_head import _features_task, _head_for

    base = PrefixClassifier.load(_features_task(), model=tiny_dir, verify=False)
    head = _head_for(base)
    head.weight[1, 2] = math.nan  # after its checks: pickled to the workers as it is
    task = base.task.replace(scoring="head", head=head)
    with TestPipeline() as p:
        result = (p | beam.Create([{"text": t} for t in TEXTS[:3]])
                  | ClassifyText(task=task, model=tiny_dir, verify=False))
        assert_that(result.labeled | "n" >> beam.combiners.Count.Globally(), equal_to([0]), label="none")
        assert_that(result.failed | beam.Map(lambda r: r["reason"]), equal_to(["non_finite_score"] * 3),
                    label="failed")
