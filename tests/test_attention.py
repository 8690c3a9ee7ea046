"""Shared-prefix attention: the same softmax as sdpa over the concatenated keys."""

import pytest
import torch
import torch.nn.functional as F

from beam_prefix import PrefixClassifier
from beam_prefix.model import attention
from beam_prefix.model.attention import shared_prefix_attention
from beam_prefix.model.loading import LoadedModel

from conftest import TEXTS, assert_same_predictions, tiny_task


def _reference(query, key, value, mask, pk, pv, scaling):
    """sdpa over [prefix expanded to the batch | new], heads repeated for GQA."""
    batch, heads = query.shape[:2]
    group = heads // key.shape[1]
    k = torch.cat([pk.expand(batch, -1, -1, -1), key], 2).repeat_interleave(group, 1)
    v = torch.cat([pv.expand(batch, -1, -1, -1), value], 2).repeat_interleave(group, 1)
    if mask.shape[-1] == key.shape[-2]:  # prefix columns implied: all visible
        mask = torch.cat([torch.ones(*mask.shape[:-1], pk.shape[-2], dtype=torch.bool), mask], -1)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling).transpose(1, 2)


@pytest.mark.parametrize("heads,kv", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("prefix_columns", [False, True])
@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("flash", [True, False])
def test_matches_sdpa_over_the_concatenation(heads, kv, prefix_columns, chunk, flash, monkeypatch):
    if chunk:  # force one row per chunk
        monkeypatch.setattr(attention, "_CHUNK_ELEMENTS", chunk)
    # the prefix part through torch's flash kernel (checked at first use) or plain matmuls
    assert attention._flash_works()
    monkeypatch.setattr(attention, "_flash_ok", flash)
    gen = torch.Generator().manual_seed(heads * 10 + kv)
    batch, q, p, d = 5, 7, 11, 8
    query = torch.randn(batch, heads, q, d, generator=gen) * 3
    key, value = torch.randn(2, batch, kv, q, d, generator=gen)
    pk, pv = torch.randn(2, 1, kv, p, d, generator=gen)
    new = torch.tril(torch.ones(q, q, dtype=torch.bool)).repeat(batch, 1, 1, 1)
    new[1, :, :, 4:] = False  # a padded row: its pad queries see themselves only
    new[1, :, torch.arange(4, q), torch.arange(4, q)] = True
    mask = new
    if prefix_columns:  # e.g. a sliding window hiding the oldest prefix keys from later queries
        seen = torch.ones(batch, 1, q, p, dtype=torch.bool)
        seen[:, :, 3:, :4] = False
        mask = torch.cat([seen, new], -1)
    # every column of the padded layout run as a token (a dense packing: the layout as it is)
    packing = attention.Packing.of_real(torch.ones(batch, q, dtype=torch.bool))
    assert packing.dense

    def flat(t):  # [B, heads, q, D] -> [1, heads, B*q, D]
        return t.transpose(0, 1).reshape(1, t.shape[1], batch * q, d)

    got = shared_prefix_attention(flat(query), flat(key), flat(value), mask, pk, pv, 0.3,
                                  packing=packing).reshape(batch, q, heads, d)
    want = _reference(query, key, value, mask, pk, pv, 0.3)
    assert got.shape == (batch, q, heads, d)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("heads,kv", [(4, 4), (6, 2), (3, 1)])
def test_one_row_runs_plain_sdpa_and_equals_the_two_part_softmax(heads, kv, monkeypatch):
    gen = torch.Generator().manual_seed(heads + kv)
    q, p, d = 7, 11, 8
    query = torch.randn(1, heads, q, d, generator=gen) * 3
    key, value = torch.randn(2, 1, kv, q, d, generator=gen)
    pk, pv = torch.randn(2, 1, kv, p, d, generator=gen)
    mask = torch.tril(torch.ones(q, q, dtype=torch.bool))[None, None]
    packing = attention.Packing.of_real(torch.ones(1, q, dtype=torch.bool))
    two_part = attention._attend_packed(query, key, value, mask, pk, pv, 0.3, packing, None)

    def refuse(*args, **kwargs):
        raise AssertionError("one row must not take the two-part path")

    monkeypatch.setattr(attention, "_attend_packed", refuse)
    got = shared_prefix_attention(query, key, value, mask, pk, pv, 0.3, packing=packing)
    want = _reference(query, key, value, mask, pk, pv, 0.3)
    assert got.shape == two_part.shape == (1, q, heads, d)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got, two_part, atol=1e-5)
    # a window hiding prefix columns, or earlier tokens of the call: the two-part path
    seen = torch.ones(1, 1, q, p, dtype=torch.bool)
    seen[:, :, 3:, :4] = False
    with pytest.raises(AssertionError, match="two-part"):
        shared_prefix_attention(query, key, value, torch.cat([seen, mask], -1), pk, pv, 0.3, packing=packing)


@pytest.mark.parametrize("heads,kv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("prefix_columns", [False, True])
@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("flash", [True, False])
def test_packed_batch_matches_sdpa_on_its_real_tokens(heads, kv, prefix_columns, chunk, flash, monkeypatch):
    """Rows of unequal length packed into one sequence: each real token's output equals
    sdpa's for the padded batch; pad columns are never computed."""
    if chunk:
        monkeypatch.setattr(attention, "_CHUNK_ELEMENTS", chunk)
    assert attention._flash_works()
    monkeypatch.setattr(attention, "_flash_ok", flash)
    gen = torch.Generator().manual_seed(heads + kv)
    lengths, q, p, d = [7, 2, 5, 1], 7, 11, 8
    batch = len(lengths)
    query = torch.randn(batch, heads, q, d, generator=gen) * 3
    key, value = torch.randn(2, batch, kv, q, d, generator=gen)
    pk, pv = torch.randn(2, 1, kv, p, d, generator=gen)
    real = torch.arange(q)[None] < torch.tensor(lengths)[:, None]
    new = torch.tril(torch.ones(q, q, dtype=torch.bool)) & real[:, None, :]
    new[:, torch.arange(q), torch.arange(q)] = True  # pad queries see themselves only
    mask = new[:, None]
    if prefix_columns:
        seen = torch.ones(batch, 1, q, p, dtype=torch.bool)
        seen[:, :, 3:, :4] = False
        mask = torch.cat([seen, mask], -1)
    packing = attention.Packing.of_real(real)
    # garbage at the pad columns must not leak into any real token
    noisy = [torch.where(real[:, None, :, None], x, torch.full_like(x, 1e4)) for x in (query, key, value)]
    packed = [packing.pack(x.transpose(1, 2)).transpose(1, 2) for x in noisy]  # [1, heads, T, d]
    assert packed[0].shape == (1, heads, sum(lengths), d)
    got = shared_prefix_attention(*packed, mask, pk, pv, 0.3, packing=packing)
    want = _reference(query, key, value, mask, pk, pv, 0.3)  # [B, q, heads, d]
    assert got.shape == (1, sum(lengths), heads, d)
    assert torch.allclose(got[0], want[real], atol=1e-5), (got[0] - want[real]).abs().max()
    assert torch.equal(packing.unpack(got)[~real], torch.zeros(int((~real).sum()), heads, d))


def test_cached_forward_runs_only_real_tokens(tiny_models):
    """Shared-prefix batches reach the model packed: one sequence of exactly the rows'
    suffix tokens (plus each row's copy of the label trie), no padding."""
    clf = PrefixClassifier(task=tiny_task(), loaded=tiny_models["llama"], verify=False, batch_size=len(TEXTS))
    assert clf.prefix_attention == "shared"
    shapes = []
    embed = clf.model.get_input_embeddings()
    handle = embed.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        clf.classify(TEXTS)
    finally:
        handle.remove()
    suffix_tokens = sum(len(clf.encode(text).suffix_ids) for text in TEXTS)
    assert shapes == [(1, suffix_tokens)]


def _copy(loaded, attn_implementation):
    """A copy of the model on another attention implementation. The config is copied too:
    `from_config` writes the implementation into the config it is given, which would switch
    the session's shared model under every later test."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.model.config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.load_state_dict(loaded.model.state_dict())
    return model.eval()


def test_enabling_keeps_every_other_forward_identical(tiny_models):
    model = _copy(tiny_models["qwen2_sliding"], "sdpa")  # the session's models may be switched already
    assert model.config._attn_implementation == "sdpa"
    ids = torch.tensor([[5, 9, 100, 7, 3, 2000, 41, 8] * 5])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert attention.enable_shared_prefix(model)
        assert model.config._attn_implementation == attention.SHARED_SDPA
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_auto_falls_back_to_the_expanded_cache_on_eager(tiny_models):
    """A model on eager attention keeps it: auto picks the expanded working cache."""
    base = tiny_models["llama"]
    model = _copy(base, "eager")
    loaded = LoadedModel(model, base.tokenizer, "tiny-llama-eager")
    clf = PrefixClassifier(task=tiny_task(), loaded=loaded, verify=True)
    assert clf.prefix_attention == "expanded" and model.config._attn_implementation == "eager"
    assert_same_predictions(clf.classify(TEXTS), clf.classify_full(TEXTS))
    with pytest.raises(ValueError, match="prefix_attention='shared' needs"):
        PrefixClassifier(task=tiny_task(), loaded=loaded, verify=False, prefix_attention="shared")
