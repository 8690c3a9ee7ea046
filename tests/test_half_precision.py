"""Half precision (`half_precision`): only the base model's linear layers compute in
bf16/fp16, everything a result depends on beyond them stays float32; cached results equal
full re-encoding within the dtype's documented tolerance on every architecture; a head's
fingerprint tells the precisions apart, at launch as on the worker; and on the embedded
model the half-precision answers stay far closer to float32's than a model cast to bf16
whole."""

from __future__ import annotations

import copy

import pytest
import torch

from beam_prefix import PrefixClassifier, fit_head
from beam_prefix.model.half_precision import (TOLERANCE, HalfLinear, compute_dtype, half_linears,
                                              precision_name)
from beam_prefix.model.loading import LoadedModel, load_model, precision_of
from beam_prefix.errors import TaskSpecError

from conftest import ARCHS, TEXTS, tiny_task

LABELS = ("billing", "technical", "account")


def _half(loaded: LoadedModel, dtype=torch.bfloat16) -> LoadedModel:
    model = copy.deepcopy(loaded.model)
    half_linears(model, dtype)
    return LoadedModel(model, loaded.tokenizer, loaded.model_id)


def test_half_linear_is_the_gemm_of_the_rounded_operands_with_a_float32_bias():
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(24, 16)
    x = torch.randn(2, 5, 24, generator=gen)
    half = HalfLinear(lin.weight, lin.bias, torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16 and half.bias.dtype == torch.float32
    got = half(x)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 16)
    rounded = torch.nn.functional.linear(x.bfloat16().float(), lin.weight.detach().bfloat16().float())
    expected = rounded.bfloat16().float() + lin.bias.detach()
    assert torch.allclose(got, expected, atol=1e-2, rtol=1e-2)
    # and close to float32 only within bf16's rounding: a half GEMM really ran
    exact = lin(x).detach()
    assert 0 < (got - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_base_models_linears_are_half_and_the_rest_float32(tiny_models, arch):
    loaded = tiny_models[arch]
    half = _half(loaded).model
    switched = [m for m in half.base_model.modules() if isinstance(m, HalfLinear)]
    assert switched and all(m.weight.dtype == torch.bfloat16 for m in switched)
    # no linear (nor GPT-2's Conv1D) left in float32 under the base model
    assert not [m for m in half.base_model.modules() if isinstance(m, torch.nn.Linear)
                or type(m).__name__ == "Conv1D"]
    others = [p for n, p in half.named_parameters() if not any(p is m.weight for m in switched)]
    assert others and all(p.dtype == torch.float32 for p in others)  # embeddings, norms, biases, LM head
    assert half.get_output_embeddings().weight.dtype == torch.float32
    assert compute_dtype(half) == torch.bfloat16 and precision_name(half) == "bfloat16-linears"
    assert compute_dtype(loaded.model) == torch.float32 and precision_name(loaded.model) == "float32"
    clf = PrefixClassifier(task=tiny_task(), loaded=LoadedModel(half, loaded.tokenizer, loaded.model_id), verify=False)
    states = clf.embed(TEXTS[:3], layers=(-1, 1))
    assert all(isinstance(v, float) for v in states[0].features)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("calibration", [False, True])
def test_cached_equals_full_reencoding_within_the_dtypes_tolerance(tiny_models, arch, calibration):
    half = _half(tiny_models[arch])
    task = tiny_task(calibration=calibration)
    clf = PrefixClassifier(task=task, loaded=half, verify=True, batch_size=5)  # the self-check passes
    assert clf.atol == TOLERANCE[torch.bfloat16]
    cached, full = clf.classify(TEXTS), clf.classify_full(TEXTS)
    worst = max(abs(c.scores[k] - f.scores[k]) for c, f in zip(cached, full) for k in f.scores)
    assert worst <= TOLERANCE[torch.bfloat16]
    # the half-precision engine really differs from float32's (else this proves nothing)
    fp32 = PrefixClassifier(task=task, loaded=tiny_models[arch], verify=False).classify(TEXTS)
    assert max(abs(c.scores[k] - f.scores[k]) for c, f in zip(cached, fp32) for k in f.scores) > 1e-6


def test_load_model_gives_half_linears_and_the_launch_check_names_the_same_precision(tiny_dir):
    for dtype, name in (("float32", "float32"), ("bfloat16", "bfloat16-linears"), ("bf16", "bfloat16-linears")):
        loaded = load_model(tiny_dir, dtype=dtype)
        assert precision_name(loaded.model) == precision_of(dtype) == name
    with pytest.raises(ValueError, match="dtype must be one of"):
        precision_of("int8")


def test_a_head_fit_in_one_precision_is_refused_in_the_other_at_launch_and_on_the_worker(tiny_dir):
    texts = TEXTS * 2
    labels = [LABELS[i % 3] for i in range(len(texts))]
    fp32, half = load_model(tiny_dir), load_model(tiny_dir, dtype="bfloat16")
    fp32_head = fit_head(PrefixClassifier(task=tiny_task(), loaded=fp32, verify=False), texts, labels, folds=2,
                         lexical=False)
    half_head = fit_head(PrefixClassifier(task=tiny_task(), loaded=half, verify=False), texts, labels, folds=2,
                         lexical=False)
    assert fp32_head.fingerprint != half_head.fingerprint
    for head, loaded, other, other_dtype in ((fp32_head, fp32, half, "bfloat16"), (half_head, half, fp32, "float32")):
        task = tiny_task().replace(scoring="head", head=head)
        with pytest.raises(TaskSpecError, match="was fit on features"):
            PrefixClassifier(task=task, loaded=other, verify=False)
        with pytest.raises(ValueError, match=f"was fit in {head.dtype}"):  # the head records its precision
            PrefixClassifier.check_fits(task, tiny_dir, dtype=other_dtype)
        PrefixClassifier.check_fits(task, tiny_dir)  # given none: the head's
        PrefixClassifier.check_fits(task, tiny_dir, dtype="float32" if head is fp32_head else "bf16")
        answered = PrefixClassifier(task=task, loaded=loaded, verify=True)  # its own precision: answers
        assert answered.mode == "head" and {p.label for p in answered.classify(TEXTS)} <= set(LABELS)


def test_pipelines_fit_in_bfloat16_gives_a_head_that_classify_runs_in_bfloat16_only(tiny_dir, tmp_path, capsys):
    """Classify follows the head's precision when given no --dtype, and refuses another
    one at launch, before any worker."""
    import os

    from beam_prefix.pipelines import classify, fit

    from conftest import ROOT, SUPPORT_TASK

    sample = os.path.join(ROOT, "pipelines", "data", "sample_tickets.csv")
    head = tmp_path / "support.head"
    assert fit.main(["--runner=DirectRunner", "--task=support_tickets", f"--input={sample}", "--label_column=label",
                     f"--output={head}", f"--model={tiny_dir}", "--dtype=bfloat16", "--folds=3"]) == 0
    text = open(SUPPORT_TASK, encoding="utf-8").read().replace("calibration: true", "calibration: false")
    (tmp_path / "task.yaml").write_text(text.replace("scoring: auto", "scoring: head\nhead: support.head"))
    common = ["--runner=DirectRunner", f"--task={tmp_path}/task.yaml", f"--input={sample}", f"--model={tiny_dir}"]
    capsys.readouterr()
    assert classify.main([*common, "--dtype=float32", f"--output={tmp_path}/fp32/"]) == 2  # refused at launch
    assert "was fit in bfloat16" in capsys.readouterr().err
    assert not (tmp_path / "fp32").exists()
    for flags in (["--dtype=bfloat16"], []):  # named, or followed
        summary = classify.run([*common, *flags, f"--output={tmp_path}/bf16{len(flags)}/"])
        assert summary["labeled"] == 60 and summary["failed"] == 0


def test_on_the_embedded_model_half_linears_stay_close_to_float32(embedded):
    """Held-out support tickets, LM label scoring: bf16 linears against float32 and against a
    model cast to bf16 whole (what `dtype=bfloat16` was before)."""
    import csv
    import os

    from conftest import ROOT

    with open(os.path.join(ROOT, "pipelines", "data", "heldout_tickets.csv"), encoding="utf-8") as f:
        texts = [r["text"] for r in csv.DictReader(f)]
    task = tiny_task(calibration=True)

    def probabilities(loaded, verify=False):
        clf = PrefixClassifier(task=task, loaded=loaded, batch_size=32, verify=verify)
        return clf.classify(texts)

    fp32 = probabilities(embedded)
    linears = probabilities(_half(embedded), verify=True)  # the start-up self-check passes at its tolerance
    whole_model = copy.deepcopy(embedded.model).to(torch.bfloat16)
    whole = probabilities(LoadedModel(whole_model, embedded.tokenizer, embedded.model_id))

    def distance(preds):
        return sum(abs(a.scores[k] - b.scores[k]) for a, b in zip(preds, fp32) for k in a.scores) / len(texts)

    assert distance(linears) < 0.5 * distance(whole)
    agree = sum(a.label == b.label for a, b in zip(linears, fp32))
    assert agree >= sum(a.label == b.label for a, b in zip(whole, fp32)) and agree >= 0.9 * len(texts)


def test_extraction_refused_by_its_self_check_in_half_precision_says_why(tiny_models, monkeypatch):
    import dataclasses

    from beam_prefix.engines.extractor import Extractor
    from beam_prefix.errors import VerificationError

    from conftest import ROOT

    task = Extractor._read_task(str(ROOT / "pipelines" / "tasks" / "ticket_fields.yaml"))
    for loaded, hint in ((tiny_models["llama"], False), (_half(tiny_models["llama"]), True)):
        ex = Extractor(task=task, loaded=loaded, verify=False)
        real_full = ex.extract_full
        # full re-encoding that decodes one token differently: what bf16 rounding does at a near tie
        monkeypatch.setattr(ex, "extract_full", lambda texts: [dataclasses.replace(e, tokens=list(e.tokens) + [0])
                                                                for e in real_full(texts)])
        with pytest.raises(VerificationError, match="cached decoding differs") as raised:
            ex.verify(TEXTS[:2])
        assert ("extract in float32" in str(raised.value)) == hint
