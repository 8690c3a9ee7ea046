"""The RunInference handler: Beam's handler contract (batching arguments, inference args,
model updates, sharing across processes), thread safety, and bad texts failing alone."""

from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.ml.inference.base import ModelMetadata, RunInference
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_prefix import PrefixClassifier
from beam_prefix.beam.handler import PrefixCachedModelHandler
from beam_prefix.model.loading import load_model

from conftest import TEXTS, run_in_threads, tiny_task

LABELS = ("billing", "technical", "account")


def _task(**changes):
    return tiny_task(LABELS, **{"overflow": "reject", "max_text_tokens": 64, **changes})


def _labels(model_dir, texts, task=None):
    clf = PrefixClassifier(task=task or _task(), loaded=load_model(model_dir), verify=False)
    return [(t, p.label) for t, p in zip(texts, clf.classify_full(texts))]


def test_run_inference_handler_is_thread_safe(tiny_dir):
    handler = PrefixCachedModelHandler(task=_task(), model=tiny_dir, batch_size=4, verify=False)
    model = handler.load_model()
    single = {r.example: r.inference.scores for r in handler.run_inference(TEXTS, model)}
    results = run_in_threads(
        lambda i: [r for _ in range(3) for r in handler.run_inference(TEXTS[i:] + TEXTS[:i], model)], 6)
    for per_thread in results:
        for r in per_thread:
            for name, p in single[r.example].items():
                assert abs(r.inference.scores[name] - p) <= 1e-5
    assert model.classifier.cache_length() == model.classifier.prefix_length


def test_run_inference_in_a_pipeline(tiny_dir):
    with TestPipeline() as p:
        labels = (p | beam.Create(TEXTS)
                  | RunInference(PrefixCachedModelHandler(task=_task(), model=tiny_dir, batch_size=4))
                  | beam.Map(lambda r: (r.example, r.inference.label)))
        assert_that(labels, equal_to(_labels(tiny_dir, TEXTS)))


def test_beam_handler_arguments_are_accepted():
    handler = PrefixCachedModelHandler(task=_task(), batch_size=8, min_batch_size=2, max_batch_duration_secs=5,
                                       large_model=True, env_vars={"TOKENIZERS_PARALLELISM": "false"})
    assert handler.batch_elements_kwargs() == {"min_batch_size": 2, "max_batch_size": 8,
                                               "max_batch_duration_secs": 5}
    assert handler.share_model_across_processes()
    assert PrefixCachedModelHandler(task=_task(), model_copies=2).model_copies() == 2
    assert not PrefixCachedModelHandler(task=_task()).share_model_across_processes()


def test_inference_args_are_refused():
    handler = PrefixCachedModelHandler(task=_task())
    with pytest.raises(ValueError, match="takes no inference_args"):
        with beam.Pipeline() as p:
            _ = p | beam.Create(TEXTS) | RunInference(handler, inference_args={"temperature": 0.0})


def test_a_bad_text_fails_alone_under_exception_handling(tiny_dir):
    bad = [None, 12345, "   ", b"\xff\xfe not utf-8", "word " * 400]  # the last: over budget, reject
    with TestPipeline() as p:
        main, dlq = (p | beam.Create(TEXTS[:5] + bad, reshuffle=False)
                     | RunInference(PrefixCachedModelHandler(task=_task(), model=tiny_dir, batch_size=16,
                                                             min_batch_size=16)).with_exception_handling())
        assert_that(main | beam.Map(lambda r: (r.example, r.inference.label)),
                    equal_to(_labels(tiny_dir, TEXTS[:5])), label="GoodRowsAllLabelled")
        # each bad element alone, as (element, (exception type, message, traceback))
        errors = dlq.failed_preprocessing[0] | beam.Map(lambda e: (e[0], e[1][0].__name__))
        assert_that(errors, equal_to([(b, "RowError") for b in bad[:4]] + [(bad[4], "TextTooLongError")]),
                    label="BadRowsFailAlone")
        assert_that(dlq.failed_inferences, equal_to([]), label="NoBatchFailed")


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, tiny_models):
    """A second model (the tiny Qwen2), to switch to."""
    path = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    tiny_models["qwen2_sliding"].model.save_pretrained(path)
    tiny_models["qwen2_sliding"].tokenizer.save_pretrained(path)
    return str(path)


def test_model_update_reloads_and_a_bad_path_fails_loudly(tiny_dir, other_dir, tmp_path):
    texts = TEXTS[:6]
    expected = _labels(other_dir, texts)
    assert expected != _labels(tiny_dir, texts)  # the update is visible in the labels
    with TestPipeline() as p:
        update = p | "Update" >> beam.Create([ModelMetadata(model_id=other_dir, model_name="qwen2")])
        results = (p | beam.Create(texts)
                   | RunInference(PrefixCachedModelHandler(task=_task(), model=tiny_dir, batch_size=4),
                                  model_metadata_pcoll=update))
        assert_that(results | beam.Map(lambda r: (r.example, r.inference.label)), equal_to(expected),
                    label="NewModelLabels")
        assert_that(results | beam.Map(lambda r: r.model_id) | beam.Distinct(), equal_to([other_dir]),
                    label="NewModelId")

    with pytest.raises(Exception, match="cannot load"):
        with beam.Pipeline() as p:
            update = p | "Update" >> beam.Create([ModelMetadata(model_id=str(tmp_path / "missing"), model_name="x")])
            _ = (p | beam.Create(texts)
                 | RunInference(PrefixCachedModelHandler(task=_task(), model=tiny_dir, batch_size=4),
                                model_metadata_pcoll=update))


def test_large_model_is_shared_across_worker_processes(tiny_dir):
    options = PipelineOptions(["--direct_running_mode=multi_processing", "--direct_num_workers=2"])
    with beam.Pipeline(options=options) as p:
        labels = (p | beam.Create(TEXTS)
                  | RunInference(PrefixCachedModelHandler(task=_task(), model=tiny_dir, batch_size=4,
                                                          large_model=True))
                  | beam.Map(lambda r: (r.example, r.inference.label)))
        assert_that(labels, equal_to(_labels(tiny_dir, TEXTS)))


def test_each_text_is_tokenized_once(tiny_dir, monkeypatch):
    """The preprocessing step's encoding travels with the text (a `ValidText`)."""
    from beam_prefix.tasks.prompt import PromptLayout

    expected = _labels(tiny_dir, TEXTS[:6])
    calls = []
    original = PromptLayout.encode

    def counting(self, text):
        calls.append(text)
        return original(self, text)

    monkeypatch.setattr(PromptLayout, "encode", counting)
    with TestPipeline() as p:
        labels = (p | beam.Create(TEXTS[:6])
                  | RunInference(PrefixCachedModelHandler(task=_task(), model=tiny_dir, batch_size=4, verify=False))
                  | beam.Map(lambda r: (r.example, r.inference.label)))
        assert_that(labels, equal_to(expected))
    assert sorted(calls) == sorted(TEXTS[:6])


KEYED_BAD = [("k-none", None), ("k-int", 12345), ("k-long", "word " * 400)]


@pytest.mark.parametrize("exception_handling", [True, False])
def test_keyed_handler_isolates_bad_texts(tiny_dir, exception_handling):
    from beam_prefix.beam.handler import KeyedPrefixCachedModelHandler

    good = [(f"k{i}", t) for i, t in enumerate(TEXTS[:5])]
    expected = [(k, label) for (k, _), (_, label) in zip(good, _labels(tiny_dir, [t for _, t in good]))]
    handler = KeyedPrefixCachedModelHandler(task=_task(), model=tiny_dir, batch_size=16, min_batch_size=16,
                                            verify=False)
    if not exception_handling:  # only good texts: the keyed path labels them; a bad one fails the run
        with TestPipeline() as p:
            out = p | beam.Create(good) | RunInference(handler)
            assert_that(out | beam.Map(lambda kv: (kv[0], kv[1].inference.label)), equal_to(expected))
        with pytest.raises(Exception, match="text is null"):
            with TestPipeline() as p:
                _ = p | beam.Create(good + KEYED_BAD[:1]) | RunInference(handler)
        return
    with TestPipeline() as p:
        main, dlq = (p | beam.Create(good + KEYED_BAD, reshuffle=False)
                     | RunInference(handler).with_exception_handling())
        assert_that(main | beam.Map(lambda kv: (kv[0], kv[1].example, kv[1].inference.label)),
                    equal_to([(k, t, label) for (k, t), (_, label) in zip(good, expected)]), label="GoodLabelled")
        assert_that(dlq.failed_preprocessing[0] | beam.Map(lambda e: (e[0][0], e[1][0].__name__)),
                    equal_to([("k-none", "RowError"), ("k-int", "RowError"), ("k-long", "TextTooLongError")]),
                    label="BadAlone")
        assert_that(dlq.failed_inferences, equal_to([]), label="NoBatchFailed")


def test_beams_keyed_wrapper_takes_the_handler_without_its_validation_step(tiny_dir):
    from apache_beam.ml.inference.base import KeyedModelHandler

    good = [(f"k{i}", t) for i, t in enumerate(TEXTS[:4])]
    expected = [(k, label) for (k, _), (_, label) in zip(good, _labels(tiny_dir, [t for _, t in good]))]
    handler = KeyedModelHandler(PrefixCachedModelHandler(task=_task(), model=tiny_dir, validate_texts=False,
                                                         verify=False))
    with TestPipeline() as p:
        out = p | beam.Create(good) | RunInference(handler)
        assert_that(out | beam.Map(lambda kv: (kv[0], kv[1].inference.label)), equal_to(expected))


def test_unkeyed_without_exception_handling_a_bad_text_fails_the_run(tiny_dir):
    with pytest.raises(Exception, match="text is empty"):
        with TestPipeline() as p:
            _ = p | beam.Create(TEXTS[:3] + ["  "]) | RunInference(
                PrefixCachedModelHandler(task=_task(), model=tiny_dir, verify=False))


def test_batch_weight_is_refused_where_beam_cannot_batch_by_it():
    from apache_beam.transforms.util import BatchElements
    import inspect
    if "max_batch_weight" in inspect.signature(BatchElements.__init__).parameters:
        handler = PrefixCachedModelHandler(task=_task(), max_batch_weight=64, element_size_fn=len)
        assert handler.batch_elements_kwargs()["max_batch_weight"] == 64
    else:
        with pytest.raises(TypeError, match="does not batch by weight"):
            PrefixCachedModelHandler(task=_task(), max_batch_weight=64, element_size_fn=len)


def test_an_unknown_handler_argument_is_refused():
    with pytest.raises(TypeError, match="unexpected keyword"):
        PrefixCachedModelHandler(task=_task(), max_batch_sizes=4)
