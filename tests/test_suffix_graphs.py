"""The suffix pass at fixed shapes (#36): buckets run here, on the CPU, and give the packed
path's results; they ask the host nothing inside the pass (what a CUDA graph needs); the
graphs themselves run only where CUDA is (skipped here)."""

from __future__ import annotations

import pytest
import torch

from beam_prefix import PrefixClassifier
from beam_prefix.model.forward import Step, forward
from beam_prefix.model.suffix_graphs import BUCKETS, bucket

from conftest import ARCHS, BANKING_LABELS, TEXTS, run_in_threads, tiny_task
from test_host_syncs import _syncs


def test_buckets_round_up_by_less_than_half():
    sizes = range(1, 5000)
    padded = [bucket(n) for n in sizes]
    assert all(p >= n for p, n in zip(padded, sizes))
    assert all(p < 1.5 * n for p, n in zip(padded, sizes) if n <= BUCKETS[-1])
    assert padded == sorted(padded) and len(set(padded)) < 30  # few shapes: few graphs
    assert bucket(5000) == 2 * BUCKETS[-1]
    with pytest.raises(ValueError, match="at least one row"):
        bucket(0)


def _pair(loaded, task, **kwargs):
    packed = PrefixClassifier(task=task, loaded=loaded, verify=False, batch_size=8, **kwargs)
    buckets = PrefixClassifier(task=task, loaded=loaded, verify=True, batch_size=8, suffix_pass="buckets", **kwargs)
    return packed, buckets


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("labels", ["first_token", "exhaustive"])
def test_buckets_give_the_packed_paths_results(tiny_models, arch, labels):
    """Labels, scores and features of the padded, dense pass equal the packed pass's (the
    buckets engine's start-up self-check, cached == full re-encoding, passes too)."""
    task = tiny_task() if labels == "first_token" else tiny_task(BANKING_LABELS[:4])
    packed, buckets = _pair(tiny_models[arch], task, label_search="exhaustive")
    assert buckets.mode == ("first_token" if labels == "first_token" else "sequence")
    a, b = packed.classify(TEXTS), buckets.classify(TEXTS)
    assert [p.label for p in a] == [p.label for p in b]
    assert max(abs(p.scores[k] - q.scores[k]) for p, q in zip(a, b) for k in p.scores) < 1e-5
    fa = torch.tensor([e.features for e in packed.embed(TEXTS, layers=(1, -1), pooling="mean")])
    fb = torch.tensor([e.features for e in buckets.embed(TEXTS, layers=(1, -1), pooling="mean")])
    assert torch.allclose(fa, fb, atol=1e-5)
    shapes = buckets._prompt.prefix_cache.graphs.shapes
    assert shapes and all(rows in BUCKETS and cols in BUCKETS for _, _, rows, cols, _ in shapes)


@pytest.mark.parametrize("arch", ["llama", "qwen2_sliding"])
def test_buckets_on_the_gpus_attention_kernels(tiny_models, monkeypatch, arch):
    """Off the CPU the prefix part is plain matmuls, not torch's CPU flash kernel: the
    buckets give the packed results on that branch too (what a GPU runs)."""
    from beam_prefix.model import attention

    assert attention._flash_works()
    monkeypatch.setattr(attention, "_flash_ok", False)
    packed, buckets = _pair(tiny_models[arch], tiny_task(BANKING_LABELS[:4]), label_search="exhaustive")
    a, b = packed.classify(TEXTS), buckets.classify(TEXTS)
    assert [p.label for p in a] == [p.label for p in b]
    assert max(abs(p.scores[k] - q.scores[k]) for p, q in zip(a, b) for k in p.scores) < 1e-5


def test_a_head_answers_alike_on_buckets(tiny_models):
    from beam_prefix import fit_head

    base = PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False)
    head = fit_head(base, TEXTS[:12], ["billing", "technical", "account"] * 4, folds=2, layers=(1, -1),
                    pooling="mean")
    packed, buckets = _pair(tiny_models["llama"], tiny_task().replace(scoring="head", head=head))
    a, b = packed.classify(TEXTS), buckets.classify(TEXTS)
    assert [p.label for p in a] == [p.label for p in b]
    assert max(abs(p.score - q.score) for p, q in zip(a, b)) < 1e-5


def test_steps_of_one_bucket_share_its_shape(tiny_models):
    clf = PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False, suffix_pass="buckets")
    prefix, model = clf._prompt.prefix_cache, clf.model

    def run(rows):
        with torch.inference_mode():
            forward(model, prefix, Step.suffixes(rows, prefix.length, "cpu"))

    run([[5] * 3, [6] * 5, [7] * 7])
    run([[5] * 2, [6] * 6, [7] * 8])  # 3 rows of width <= 8: the same bucket
    assert len(prefix.graphs.shapes) == 1
    run([[5] * 9])
    assert {(r, c) for _, _, r, c, _ in prefix.graphs.shapes} == {(3, 8), (1, 12)}


@pytest.mark.parametrize("arch,flash", [("llama", True), ("llama", False), ("mistral_sliding", True)])
def test_the_bucketed_pass_asks_the_host_nothing(tiny_models, monkeypatch, arch, flash):
    """A CUDA graph replays a pass only if nothing in it waits for the host: the bucketed
    forward makes no `.item()`/`.tolist()`/`nonzero` (the packed one needs its `nonzero`).
    On a sliding-window layer the prefix part asks which columns a window hides, so such
    a prefix is run eagerly, never captured: only full attention is checked bare. Without
    the CPU's flash kernel (`flash` False) the prefix part runs as on a GPU."""
    from beam_prefix.model import attention

    if not flash:
        monkeypatch.setattr(attention, "_flash_ok", False)
    packed = PrefixClassifier(task=tiny_task(), loaded=tiny_models[arch], verify=False)
    buckets = PrefixClassifier(task=tiny_task(), loaded=tiny_models[arch], verify=False, suffix_pass="buckets")
    rows = [packed.encode(t).suffix_ids for t in TEXTS[:6]]
    counts = {}
    for name, clf in (("packed", packed), ("buckets", buckets)):
        prefix = clf._prompt.prefix_cache
        step = Step.suffixes(rows, prefix.length, "cpu")
        with torch.inference_mode():
            forward(clf.model, prefix, step, layers=(1, -1))  # warm
            counts[name] = _syncs(lambda: forward(clf.model, prefix, step, layers=(1, -1)))
    assert counts["packed"]["aten::nonzero"] >= 1  # the count is real
    if arch == "llama":
        assert sum(counts["buckets"].values()) == 0, counts["buckets"]
    else:
        assert counts["buckets"]["aten::nonzero"] >= 1


def test_buckets_are_shared_by_threads(tiny_models):
    clf = PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False, suffix_pass="buckets",
                           batch_size=4)
    expected = [(p.label, p.score) for p in clf.classify(TEXTS)]
    results = run_in_threads(lambda i: [(p.label, p.score) for p in clf.fork().classify(TEXTS)], 4)
    assert all(r == expected for r in results)


def test_suffix_pass_is_checked(tiny_models):
    with pytest.raises(ValueError, match="suffix_pass must be one of"):
        PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False, suffix_pass="fast")
    with pytest.raises(ValueError, match="needs shared-prefix attention"):
        PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False, suffix_pass="buckets",
                         prefix_attention="expanded")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; this model is on cpu"):
            PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False, suffix_pass="graphs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs run only on a CUDA device")
def test_graphs_replay_the_eager_results_on_cuda(tiny_models):
    import copy

    from beam_prefix.model.loading import LoadedModel

    loaded = tiny_models["llama"]
    on_gpu = LoadedModel(copy.deepcopy(loaded.model).cuda(), loaded.tokenizer, loaded.model_id)
    packed = PrefixClassifier(task=tiny_task(), loaded=on_gpu, verify=False, batch_size=8)
    graphs = PrefixClassifier(task=tiny_task(), loaded=on_gpu, verify=True, batch_size=8, suffix_pass="graphs")
    a = packed.classify(TEXTS)
    for _ in range(2):  # the second time replays the graphs the first recorded
        b = graphs.classify(TEXTS)
        assert [p.label for p in a] == [p.label for p in b]
        assert max(abs(p.score - q.score) for p, q in zip(a, b)) < 1e-5
    recorded = graphs._prompt.prefix_cache.graphs
    assert recorded.captured == len(recorded.shapes) >= 1


def test_a_graph_that_cannot_be_recorded_leaves_the_buckets_running(monkeypatch):
    """Recording is tried once; if it fails, the pass runs eagerly from then on, and says why."""
    from beam_prefix.model.suffix_graphs import SuffixGraphs

    graphs = SuffixGraphs(torch.device("cpu"), capture=False)
    graphs.capture = True  # as on a CUDA device, whose recording is made to fail here

    def fail(inputs, run_pass):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_record", fail)
    calls = []
    run_pass = lambda x: (calls.append(1) or x * 2,)
    first = graphs.run(("k",), {"x": torch.ones(2)}, run_pass, capturable=True)
    again = graphs.run(("k",), {"x": torch.ones(2)}, run_pass, capturable=True)
    assert torch.equal(first[0], torch.full((2,), 2.0)) and torch.equal(again[0], first[0]) and len(calls) == 2
    assert graphs.captured == 0 and not graphs.capture and "stream is capturing" in graphs.failure


def _expect_labelled(tiny_dir, expected, **kwargs):
    """Run `ClassifyText(**kwargs)` on `TEXTS`; its rows must carry `expected`'s labels and
    (within 1e-5) scores, none failed."""
    import apache_beam as beam
    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.util import BeamAssertException, assert_that

    from beam_prefix.beam.classify_transform import ClassifyText

    want = {t: (p.label, p.score) for t, p in zip(TEXTS, expected)}

    def matches(rows):
        got = {r["text"]: (r["label"], r["score"]) for r in rows}
        if got.keys() != want.keys() or any(got[t][0] != want[t][0] or abs(got[t][1] - want[t][1]) > 1e-5
                                            for t in want):
            raise BeamAssertException(f"{kwargs}: {got} != {want}")

    with TestPipeline() as p:
        out = p | beam.Create([{"text": t} for t in TEXTS]) | ClassifyText(task=tiny_task(), model=tiny_dir, **kwargs)
        assert_that(out.labeled, matches)
        assert_that(out.failed, lambda failed: None if not failed else pytest.fail(f"failed rows: {failed}"),
                    label="none failed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a worker without a GPU")
def test_classify_text_runs_its_suffix_pass_or_packed_where_no_gpu_is(tiny_dir, caplog, monkeypatch):
    """`ClassifyText(suffix_pass=...)`: buckets give the packed labels and scores; graphs
    with device auto on a worker without a GPU run packed, saying so."""
    import logging

    from beam_prefix.model.suffix_graphs import SuffixGraphs

    passes = []  # the DirectRunner runs the workers in this process
    original = SuffixGraphs.run
    monkeypatch.setattr(SuffixGraphs, "run", lambda self, *a, **k: passes.append(1) or original(self, *a, **k))
    expected = PrefixClassifier.load(tiny_task(), tiny_dir, verify=False).classify(TEXTS)
    _expect_labelled(tiny_dir, expected)
    assert not passes
    _expect_labelled(tiny_dir, expected, suffix_pass="buckets")
    assert passes  # the workers' batches did run in buckets
    passes.clear()
    with caplog.at_level(logging.INFO, logger="beam_prefix.model.suffix_graphs"):
        _expect_labelled(tiny_dir, expected, suffix_pass="graphs", device="auto")
    assert "so its batches run packed" in caplog.text and not passes


def test_graphs_on_a_cpu_device_are_refused_where_the_step_is_built(tiny_dir, tmp_path, capsys):
    from beam_prefix.beam.classify_transform import ClassifyText
    from beam_prefix.pipelines import classify, extract

    with pytest.raises(ValueError, match="suffix_pass='graphs' records CUDA graphs"):
        ClassifyText(task=tiny_task(), model=tiny_dir, suffix_pass="graphs")
    with pytest.raises(ValueError, match="suffix_pass must be one of"):
        ClassifyText(task=tiny_task(), model=tiny_dir, suffix_pass="graph")
    sample = str(tmp_path / "in.csv")
    with open(sample, "w", encoding="utf-8") as f:
        f.write("text\napp crashes\n")
    assert classify.main(["--runner=DirectRunner", f"--input={sample}", "--suffix_pass=graphs"]) == 2
    assert "--suffix_pass=graphs records CUDA graphs" in capsys.readouterr().err
    assert extract.main(["--runner=DirectRunner", f"--input={sample}", "--suffix_pass=buckets"]) == 2
    assert "--suffix_pass" in capsys.readouterr().err  # a classification flag: extraction refuses it


def test_the_runinference_handler_takes_a_suffix_pass(tiny_dir):
    from beam_prefix.beam.handler import PrefixCachedModelHandler

    with pytest.raises(ValueError, match="suffix_pass='graphs' records CUDA graphs"):
        PrefixCachedModelHandler(task=tiny_task(), model=tiny_dir, suffix_pass="graphs")
    with pytest.raises(ValueError, match="suffix_pass must be one of"):
        PrefixCachedModelHandler(task=tiny_task(), model=tiny_dir, suffix_pass="fast")
    packed = PrefixCachedModelHandler(task=tiny_task(), model=tiny_dir, verify=False).load_model()
    served = PrefixCachedModelHandler(task=tiny_task(), model=tiny_dir, suffix_pass="buckets").load_model()
    assert packed.classifier._prompt.prefix_cache.graphs is None
    assert served.classifier._prompt.prefix_cache.graphs is not None
    a, b = packed.classify(TEXTS), served.classify(TEXTS)
    assert [p.label for p in a] == [p.label for p in b]
    assert max(abs(p.score - q.score) for p, q in zip(a, b)) < 1e-5
    if not torch.cuda.is_available():  # auto landed on the CPU: packed
        auto = PrefixCachedModelHandler(task=tiny_task(), model=tiny_dir, suffix_pass="graphs", device="auto")
        assert auto.load_model().classifier._prompt.prefix_cache.graphs is None
