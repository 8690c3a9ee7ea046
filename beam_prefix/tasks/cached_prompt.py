"""A task's prompt prepared over a loaded model: what every prefix-cached engine starts from.

`CachedPrompt.build` takes a task rendered for the model's tokenizer (`PromptLayout`) and
what an engine's kind answers after it (`Answer`: the labels, or the generated output),
checks that a row's whole prompt fits the model's positions, runs the prefix once
(`PrefixCache`) and chooses how rows attend to it (shared-prefix attention where the model
allows, else the expanded working cache). Every engine (`prefix_engine.PrefixEngine`)
holds one, so classification and extraction build, check and fingerprint prompts the same
way.

Everything here is read-only after `build` and may be shared by threads; the mutable
parts are the expanded engine's `WorkingCache`, made per caller by `working_cache()`, and
the prefix's CUDA graphs where asked for (`suffix_graphs`, behind their own lock).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

from beam_prefix.model.attention import enable_shared_prefix
from beam_prefix.errors import ContextLengthError
from beam_prefix.model.loading import LoadedModel
from beam_prefix.model.prefix_cache import PrefixCache, WorkingCache
from beam_prefix.tasks.prompt import PromptLayout

__all__ = ["CachedPrompt", "Answer", "PREFIX_ATTENTIONS", "length_batches", "check_context"]

PREFIX_ATTENTIONS = ("auto", "shared", "expanded")


@dataclasses.dataclass(frozen=True)
class Answer:
    """What follows a row's suffix, as an engine's kind defines it.

    Attributes:
        what: its name in messages (``"longest label"``, ``"max_new_tokens"``).
        tokens: the most positions it takes after the suffix.
        identity: what of it goes into the prompt fingerprint (JSON-able).
    """

    what: str
    tokens: int
    identity: dict


@dataclasses.dataclass(frozen=True)
class CachedPrompt:
    """A task rendered for a model, with its prefix computed.

    Attributes:
        layout: the rendered prompt and its token-clean split.
        answer: what follows each row's suffix (`Answer`).
        prefix_cache: the prefix's keys and values (``[1, kv_heads, P, head_dim]`` per layer).
        prefix_attention: ``"shared"`` or ``"expanded"`` (see `PrefixClassifier`).
        fingerprint: hash of everything that shapes outputs (prompt ids, answer, model id).
        build_s: seconds the prefix's forward pass took.
    """

    layout: PromptLayout
    answer: Answer
    prefix_cache: PrefixCache
    prefix_attention: str
    fingerprint: str
    build_s: float

    @classmethod
    def build(cls, layout: PromptLayout, answer: Answer, loaded: LoadedModel, *,
              prefix_attention: str = "auto", suffix_pass: str = "packed") -> "CachedPrompt":
        """`suffix_pass`: see `PrefixCache` (``buckets`` and ``graphs`` need shared-prefix attention)."""
        if prefix_attention not in PREFIX_ATTENTIONS:
            raise ValueError(f"prefix_attention must be 'auto', 'shared' or 'expanded', got {prefix_attention!r}")
        check_context(layout, answer, loaded.model.config, loaded.model_id)  # before the prefix's forward allocates
        attention = choose_prefix_attention(loaded.model, prefix_attention)
        if suffix_pass != "packed" and attention != "shared":
            raise ValueError(f"suffix_pass={suffix_pass!r} needs shared-prefix attention; this engine uses the "
                             f"expanded working cache (prefix_attention={prefix_attention!r}, attention "
                             f"{loaded.model.config._attn_implementation!r})")
        start = time.perf_counter()
        prefix = PrefixCache(loaded.model, layout.prefix_ids, suffix_pass=suffix_pass)
        return cls(layout=layout, answer=answer, prefix_cache=prefix,
                   prefix_attention=attention,
                   fingerprint=layout.fingerprint(loaded.model_id, answer.identity),
                   build_s=time.perf_counter() - start)

    def working_cache(self) -> WorkingCache | None:
        """A new per-caller working cache on the expanded engine; None under shared attention."""
        return self.prefix_cache.working_cache() if self.prefix_attention == "expanded" else None


def choose_prefix_attention(model, requested: str) -> str:
    """``"shared"`` where the model supports it (switching it to the sdpa-equivalent
    `attention.SHARED_SDPA`), unless `requested` is ``"expanded"``."""
    if requested == "expanded":
        return "expanded"
    if enable_shared_prefix(model):
        return "shared"
    if requested == "shared":
        raise ValueError(f"prefix_attention='shared' needs a model on sdpa attention that dispatches "
                         f"through transformers' AttentionInterface; this one uses "
                         f"{model.config._attn_implementation!r}")
    return "expanded"


def check_context(layout: PromptLayout, answer: Answer, config, model_id: str) -> None:
    """Refuse a prompt longer than the model's positions (`config`: the model's
    configuration, which is all this reads of the model: launchers check too; past its
    positions a model extrapolates, or fails, and a huge prefix makes one huge allocation).

    Raises:
        ContextLengthError: saying by how much, and what to shorten.
    """
    config = config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    parts = layout.max_positions(answer.tokens)
    need = sum(parts.values())
    if limit and need > limit:
        room = limit - parts["prefix"] - parts["suffix"] - parts["answer"]
        fix = (f"lower max_text_tokens to {room} or less" if room >= 1 else
               "shorten the instructions, label descriptions, fields or examples")
        raise ContextLengthError(
            f"task {layout.task.name!r}: a row's prompt can take {need:,} positions (prefix {parts['prefix']:,} + "
            f"suffix template {parts['suffix']} + text budget {parts['text']:,} + {answer.what} {parts['answer']}), "
            f"over the {limit:,} of model {model_id} (max_position_embeddings); {fix}")


def length_batches(widths: Sequence[int], batch_size: int, max_tokens: int) -> Iterator[list[int]]:
    """Row indices in batches of similar width (new tokens per row), shortest first: at
    most `batch_size` rows and, past one row, at most `max_tokens` rows x widest width."""
    batch: list[int] = []
    for i in sorted(range(len(widths)), key=widths.__getitem__):
        if batch and (len(batch) >= batch_size or (len(batch) + 1) * widths[i] > max_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch
