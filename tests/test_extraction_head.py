"""Extraction heads: fields read off the cached forward's states, fit from labelled rows.

The head reads the same suffix pass every engine runs: its logits over cached states
equal those over the whole prompt re-encoded (tiny Llama, Qwen2 and Mistral with sliding
windows, GPT-2, the embedded model; shared and expanded prefix attention), and a head fit
on synthetic tickets reads held-out tickets' fields. Spans become BIO tags and back
exactly; a span that does not parse as its field's type is null, with the reason in
``raw_output``.
"""

import json
import random

import numpy as np
import pytest
import torch

from beam_prefix.engines.extraction_fitting import fit_extraction_head, labelled_rows, tagger_candidates
from beam_prefix.engines.extractor import Extractor
from beam_prefix.errors import TaskSpecError, VerificationError
from beam_prefix.tasks.extract_task import load_task
from beam_prefix.tasks.extraction_head import ExtractionHead
from beam_prefix.tasks.span_tags import TagSet, best_path, span_value, spans_of, tag_transitions, token_tags, trimmed

from conftest import ARCHS

FIELDS = [
    {"name": "order_id", "type": "string", "required": False},
    {"name": "amount", "type": "number", "required": False},
    {"name": "area", "type": "enum", "values": ["billing", "app"]},
    {"name": "refund", "type": "boolean"},
]


def ticket_task(**changes):
    return load_task({"kind": "extract", "name": "tickets", "instructions": "Fill in the ticket's fields.",
                      "fields": FIELDS, "suffix_template": "Ticket: {text}", **changes})


def ticket_rows(n: int, seed: int = 0) -> list[dict]:
    """Synthetic labelled tickets: billing ones name an amount and an order, some ask for a
    refund; app ones name an order only."""
    rnd = random.Random(seed)
    rows = []
    for _ in range(n):
        order, amount = f"A-{rnd.randint(100, 999)}", rnd.randint(5, 90)
        if rnd.random() < 0.5:
            refund = rnd.random() < 0.5
            text = f"I was charged {amount} dollars for order {order}" + (", please refund it" if refund else "")
            fields = {"order_id": order, "amount": float(amount), "area": "billing", "refund": refund}
        else:
            text = f"The app crashes when I open order {order}"
            fields = {"order_id": order, "amount": None, "area": "app", "refund": False}
        rows.append({"text": text, "fields": fields})
    return rows


def _fit(loaded, rows, **kwargs):
    ex = Extractor(task=ticket_task(), loaded=loaded, verify=False)
    kwargs.setdefault("tagger_layers", [(1,)])
    kwargs.setdefault("folds", 2)
    return fit_extraction_head(ex, rows, **kwargs)


@pytest.fixture(scope="module")
def llama_head(tiny_models):
    return _fit(tiny_models["llama"], ticket_rows(60), tagger_layers=None, folds=3)


# -- spans as tags, and back --------------------------------------------------------------

def test_spans_become_tags_and_come_back():
    text = "order A-17 costs 40 EUR"
    offsets = trimmed([(0, 5), (5, 8), (8, 10), (10, 16), (16, 19), (19, 23)], text)
    tags = TagSet(("order_id", "amount"))
    gold = {"order_id": (6, 10), "amount": (17, 19)}
    path = token_tags(offsets, gold, tags)
    assert [tags.names[t] for t in path] == ["O", "B-order_id", "I-order_id", "O", "B-amount", "O"]
    probs = np.full((len(path), tags.size), 0.01)
    probs[np.arange(len(path)), path] = 0.9
    found = spans_of(best_path(np.log(probs), tags, np.ones(len(path), bool)), probs, offsets, tags, text)
    assert {f: (s.start, s.end) for f, s in found.items()} == gold
    assert text[found["order_id"].start:found["order_id"].end] == "A-17"


def test_best_path_never_continues_a_span_it_did_not_begin():
    tags = TagSet(("a", "b"))
    log_probs = np.log(np.array([[0.1, 0.1, 0.6, 0.1, 0.1],      # I-a most likely at the start
                                 [0.1, 0.1, 0.1, 0.1, 0.6]]))    # then I-b
    path = best_path(log_probs, tags, np.ones(2, bool))
    names = [tags.names[t] for t in path]
    for before, after in zip(["O"] + names, names):
        if after.startswith("I-"):
            assert before[2:] == after[2:], names
    # a token that is not the row's text is never tagged
    assert best_path(log_probs, tags, np.array([False, False])) == [0, 0]


def test_learned_transitions_carry_what_one_tag_says_of_the_next():
    tags = TagSet(("title", "genre"))
    b_title, i_title, b_genre = tags.begin("title"), tags.begin("title") + 1, tags.begin("genre")
    # titles run on for several tokens; a genre is one token, always followed by O
    rows = [np.array([0, b_title, i_title, i_title, 0, b_genre, 0])] * 20
    learned = tag_transitions(rows, tags.size)
    assert learned[b_title, i_title] > 0 > learned[b_title, 0]
    assert learned[b_genre, 0] > 0 > learned[b_genre, b_genre]
    # a token the per-token probabilities leave in doubt (O 0.5, I-title 0.45) after a title's B
    log_probs = np.log(np.array([[0.05, 0.9, 0.01, 0.02, 0.02],
                                 [0.5, 0.02, 0.45, 0.02, 0.01]]))
    text = np.ones(2, bool)
    assert best_path(log_probs, tags, text) == [b_title, 0]
    assert best_path(log_probs, tags, text, learned) == [b_title, i_title]
    # between a text token and one that is not, only validity counts
    assert best_path(log_probs, tags, np.array([True, False]), learned) == [b_title, 0]


def test_a_head_file_without_transitions_reads_as_none(tmp_path, tiny_models, llama_head):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from beam_prefix.tasks.extraction_head import EXTRACTION_HEAD_KEY

    llama_head.save(tmp_path / "new.head")
    with safe_open(str(tmp_path / "new.head"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if k != "tagger.transitions"}
    save_file(tensors, str(tmp_path / "old.head"), metadata={EXTRACTION_HEAD_KEY: meta[EXTRACTION_HEAD_KEY]})
    old = ExtractionHead.load(tmp_path / "old.head")
    assert not old.tagger.transitions.any() and old.tagger.transitions.shape == llama_head.tagger.transitions.shape
    # a hidden layer survives the file; half of one is refused
    mlp = _fit(tiny_models["llama"], ticket_rows(20), tagger_kinds=[("mlp", 16)])
    mlp.save(tmp_path / "mlp.head")
    again = ExtractionHead.load(tmp_path / "mlp.head")
    assert again.identity == mlp.identity and again.tagger.hidden[0].shape[0] == 16
    with safe_open(str(tmp_path / "mlp.head"), framework="pt") as f:
        mlp_meta, mlp_tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if k != "tagger.hidden_bias"}
    save_file(mlp_tensors, str(tmp_path / "half.head"), metadata=mlp_meta)
    with pytest.raises(TaskSpecError, match="needs both hidden_weight and hidden_bias"):
        ExtractionHead.load(tmp_path / "half.head")
    bad = dict(tensors, **{"tagger.transitions": torch.full_like(llama_head.tagger.transitions, float("nan"))})
    save_file(bad, str(tmp_path / "nan.head"), metadata={EXTRACTION_HEAD_KEY: meta[EXTRACTION_HEAD_KEY]})
    with pytest.raises(TaskSpecError, match="transitions holds values that are not finite"):
        ExtractionHead.load(tmp_path / "nan.head")


def test_several_spans_of_one_field_keep_the_most_probable():
    tags = TagSet(("a",))
    offsets = [(0, 1), (2, 3), (4, 5)]
    probs = np.array([[0.2, 0.7, 0.1], [0.9, 0.05, 0.05], [0.05, 0.9, 0.05]])
    found = spans_of([1, 0, 1], probs, offsets, tags, "a b c")
    assert (found["a"].start, found["a"].end) == (4, 5)


def test_a_span_cut_inside_a_word_is_widened_to_the_word():
    text = "charged $40, order A-17x"
    tags = TagSet(("amount", "order_id"))
    offsets = [(0, 7), (8, 9), (9, 10), (10, 11), (11, 12), (13, 18), (19, 21), (21, 23), (23, 24)]
    path = [0, 0, tags.begin("amount"), 0, 0, 0, tags.begin("order_id"), tags.begin("order_id") + 1, 0]
    found = spans_of(path, np.full((len(path), tags.size), 0.5), offsets, tags, text)
    assert text[found["amount"].start:found["amount"].end] == "40"  # not "4" (digits are tokens of their own)
    assert text[found["order_id"].start:found["order_id"].end] == "A-17x"  # the word's letters and digits, no comma


@pytest.mark.parametrize("text, kind, value, problem", [
    ("$1,250.50", "number", 1250.5, None), ("40", "integer", 40, None), ("4.5", "integer", None, "not an integer"),
    ("forty", "number", None, "holds 0 numbers"), ("3 to 4", "number", None, "holds 2 numbers"),
    ("2026-03-02", "date", "2026-03-02", None), ("March 2nd 2026", "date", "2026-03-02", None),
    ("next week", "date", None, "not a date"), ("A-17", "string", "A-17", None)])
def test_a_span_is_parsed_as_its_field_type_or_says_why_not(text, kind, value, problem):
    got, why = span_value(text, kind, 10 ** 15 - 1)
    assert got == value
    assert (why is None) if problem is None else (problem in why)


# -- labelled rows --------------------------------------------------------------------------

def test_labelled_rows_in_either_form():
    task = ticket_task()
    rows = labelled_rows(task, [
        {"text": "  Charged 40 for ORDER a-17 ", "fields": {"order_id": "A-17", "amount": 40.0, "area": "billing",
                                                          "refund": True}},
        {"text": "app broke on A-9", "entities": [{"start": 13, "end": 16, "label": "order_id"}],
         "fields": {"area": "app", "refund": False}},
        {"text": "charged for B-2", "fields": {"order_id": "Z-99", "area": "billing", "refund": False}}])
    first = rows[0]
    assert first.text == "Charged 40 for ORDER a-17"  # as the engine reads it: stripped, offsets shifted
    assert first.text[slice(*first.spans["amount"])] == "40"  # 40.0 found as 40
    assert first.text[slice(*first.spans["order_id"])] == "a-17"  # case-insensitive
    assert first.choices == {"area": "billing", "refund": "true"}
    assert rows[1].text[slice(*rows[1].spans["order_id"])] == "A-9"
    assert not rows[2].spans_ok  # a value the text lacks: it does not train the tagger


@pytest.mark.parametrize("row, message", [
    ({"text": "x", "fields": {"colour": "red", "area": "app", "refund": False}}, "not the task's"),
    ({"text": "x", "fields": {"area": "shop", "refund": False}}, "not one of"),
    ({"text": "x", "fields": {"area": "app"}}, "no value for ['refund']"),
    ({"text": "x y", "entities": [{"start": 0, "end": 1, "label": "area"}], "fields": {"area": "app", "refund": False}},
     "not one of the task's span fields"),
    ({"text": "x", "entities": [{"start": 0, "end": 9, "label": "order_id"}], "fields": {"area": "app", "refund": False}},
     "outside the text"),
    ({"text": "  "}, "non-empty 'text'"), ({"text": "x"}, "needs 'fields'")])
def test_bad_labelled_rows_are_refused_naming_the_row(row, message):
    with pytest.raises(ValueError, match="labelled row 1") as e:
        labelled_rows(ticket_task(), [row])
    assert message in str(e.value)


# -- the head reads the one forward ---------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("engine", ["shared", "expanded"])
@pytest.mark.parametrize("kind", [("linear", 1.0), ("mlp", 32)])
def test_head_over_cached_states_equals_full_reencoding(tiny_models, arch, engine, kind):
    loaded = tiny_models[arch]
    head = _fit(loaded, ticket_rows(24), tagger_kinds=[kind])
    assert (head.tagger.hidden is not None) == (kind[0] == "mlp")
    ex = Extractor(task=ticket_task(scoring="head", head=head), loaded=loaded, verify=False, batch_size=5,
                   prefix_attention=engine)
    texts = [r["text"] for r in ticket_rows(12, seed=1)] + ["x", "order " * 300]
    cached, full = ex.extract(texts), ex.extract_full(texts)
    for c, f in zip(cached, full):
        assert c.values == f.values and c.raw_output == f.raw_output
        np.testing.assert_allclose(c.logits.numpy(), f.logits.numpy(), atol=1e-4)
        assert c.generated_tokens == 0 and c.finished
    ex.verify()  # the start-up self-check passes too
    assert ex.cache_length() == ex.prefix_length  # nothing of the calls outlived them


def test_embedded_head_equals_full_reencoding(embedded):
    head = _fit(embedded, ticket_rows(30), tagger_kinds=[("mlp", 64)])  # (the hidden layer: the wider reading)
    ex = Extractor(task=ticket_task(scoring="head", head=head), loaded=embedded, verify=True)
    texts = [r["text"] for r in ticket_rows(6, seed=2)]
    for c, f in zip(ex.extract(texts), ex.extract_full(texts)):
        assert c.values == f.values
        np.testing.assert_allclose(c.logits.numpy(), f.logits.numpy(), atol=1e-4)


def test_a_fit_head_reads_held_out_tickets(tiny_models, llama_head):
    ex = Extractor(task=ticket_task(scoring="head", head=llama_head), loaded=tiny_models["llama"], verify=True)
    held_out = [r for r in ticket_rows(45, seed=7) if not llama_head.trained_on(r["text"])][:40]
    assert len(held_out) == 40  # rows the head never saw (a random ticket may repeat a training one)
    out = ex.extract([r["text"] for r in held_out])
    right = sum(o.values == r["fields"] for o, r in zip(out, held_out))
    assert right >= 36, [(o.values, r["fields"]) for o, r in zip(out, held_out) if o.values != r["fields"]][:3]
    assert llama_head.metrics["tagger"]["kfold_span_f1"] > 0.9
    assert set(llama_head.metrics["fields"]) == {"area", "refund"}
    # the folds weighed the learned transitions too, and the head keeps the chosen weight's
    tagger = llama_head.metrics["tagger"]
    assert {key.rsplit(" x", 1)[1] for key in tagger["kfold_span_f1_by_candidate"]} == {"0.0", "0.5", "1.0"}
    assert (tagger["transition_weight"] == 0.0) == (not llama_head.tagger.transitions.any())


def test_the_tagger_tries_two_depths_alone_and_together():
    assert tagger_candidates(30) == [(12,), (18,), (12, 18)]
    assert tagger_candidates(2) == [(1,)]


def test_a_span_that_does_not_parse_is_null_and_says_why(tiny_models):
    rows = [{"text": f"paid {w} dollars for {o}", "entities": [{"start": 5, "end": 5 + len(w), "label": "amount"}],
             "fields": {"order_id": None, "area": a, "refund": a == "app"}}
            for w, o in [("forty", "x"), ("twelve", "y"), ("nine", "z"), ("eighty", "w")] * 6
            for a in ("billing", "app")]
    loaded = tiny_models["llama"]
    head = _fit(loaded, rows)
    ex = Extractor(task=ticket_task(scoring="head", head=head), loaded=loaded, verify=False)
    out = ex.extract(["paid forty dollars for x"])[0]
    assert out.values["amount"] is None
    raw = json.loads(out.raw_output)
    assert raw["spans"]["amount"] == "forty" and "holds 0 numbers" in raw["problems"]["amount"]


def test_a_field_with_one_value_in_every_row_is_refused(tiny_models):
    rows = ticket_rows(12)
    for r in rows:
        r["fields"]["refund"] = False
    with pytest.raises(ValueError, match="field 'refund': every labelled row has the value 'false'"):
        _fit(tiny_models["llama"], rows)


def test_verify_fails_when_the_paths_disagree(tiny_models, llama_head, monkeypatch):
    ex = Extractor(task=ticket_task(scoring="head", head=llama_head), loaded=tiny_models["llama"], verify=False)
    real = ex.states_full
    monkeypatch.setattr(ex, "states_full",
                        lambda text, layers, **kw: tuple(s + 0.5 for s in real(text, layers, **kw)))
    with pytest.raises(VerificationError, match="differ from full re-encoding"):
        ex.verify()


# -- the head file and the task ------------------------------------------------------------

def test_head_file_round_trip_and_task_file(tmp_path, tiny_models, llama_head):
    path = tmp_path / "tickets.head"
    llama_head.save(path)
    again = ExtractionHead.load(path)
    assert again.identity == llama_head.identity and again.metrics == llama_head.metrics
    task_file = tmp_path / "tickets.yaml"
    task_file.write_text(json.dumps({"kind": "extract", "name": "tickets", "instructions": "Fill in the ticket's fields.",
                                     "fields": FIELDS, "suffix_template": "Ticket: {text}", "scoring": "head",
                                     "head": "tickets.head"}))
    task = load_task(str(task_file))  # the head path is read beside the task file
    assert task.head.identity == llama_head.identity
    ex = Extractor(task=task, loaded=tiny_models["llama"], verify=False)
    assert ex.extract(["The app crashes when I open order A-123"])[0].values["order_id"] == "A-123"


def test_a_head_is_refused_for_other_fields_models_or_scoring(tmp_path, tiny_models, llama_head):
    with pytest.raises(TaskSpecError, match="was fit for fields"):
        load_task({"kind": "extract", "instructions": "x", "fields": FIELDS[:3], "scoring": "head", "head": llama_head})
    with pytest.raises(TaskSpecError, match="required: false"):
        load_task({"kind": "extract", "instructions": "x", "scoring": "head", "head": llama_head,
                   "fields": [{**FIELDS[0], "required": True}, *FIELDS[1:]]})
    with pytest.raises(TaskSpecError, match="used with scoring: head"):
        ticket_task(head=llama_head)
    with pytest.raises(TaskSpecError, match="needs a head"):
        ticket_task(scoring="head")
    with pytest.raises(TaskSpecError, match="another prompt, model or dtype"):
        Extractor(task=ticket_task(scoring="head", head=llama_head), loaded=tiny_models["qwen2_sliding"], verify=False)
    with pytest.raises(TaskSpecError, match="another prompt, model or dtype"):  # another prompt
        Extractor(task=ticket_task(scoring="head", head=llama_head, instructions="Other words."),
                  loaded=tiny_models["llama"], verify=False)
    damaged = tmp_path / "damaged.head"
    damaged.write_bytes(b"not a head")
    with pytest.raises(TaskSpecError, match="not a beam-prefix extraction head"):
        ExtractionHead.load(damaged)
