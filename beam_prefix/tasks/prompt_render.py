"""How a task is written out as text, before any tokenization: the chat template (or a
plain template for tokenizers without one) with the task's system text, few-shot turns
and the row's slot, and where a template's static text splits at added tokens.

`prompt.PromptLayout` renders a task through these once, around a sentinel standing for
the row text, and cuts the result into the cached prefix and the per-row suffix.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["render_chat", "render_plain", "chat_terminator", "added_token_strings", "last_special_end",
           "first_special_start", "PLAIN_ANSWER_LEAD"]

_LABEL_SENTINEL = "@@BEAM_PREFIX_LABEL_SLOT@@"
PLAIN_ANSWER_LEAD = "Answer:"


def _chat_messages(task, text: str) -> list[dict]:
    messages = [{"role": "system", "content": task.system_text()}]
    for example, answer in task.example_turns():
        messages.append({"role": "user", "content": task.render_suffix(example)})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": task.render_suffix(text)})
    return messages


def _apply_template(tokenizer, messages, *, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception:  # templates without a system role: fold it into the first user turn
        system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
        rest[0]["content"] = system + "\n\n" + rest[0]["content"]
        return tokenizer.apply_chat_template(rest, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)


def render_chat(task, tokenizer, text: str) -> str:
    return _apply_template(tokenizer, _chat_messages(task, text), add_generation_prompt=True)


def chat_terminator(task, tokenizer) -> str:
    """What the template writes right after an assistant answer, up to its first added token."""
    messages = _chat_messages(task, "x") + [{"role": "assistant", "content": _LABEL_SENTINEL}]
    rendered = _apply_template(tokenizer, messages, add_generation_prompt=False)
    after = rendered.split(_LABEL_SENTINEL, 1)[1] if _LABEL_SENTINEL in rendered else ""
    specials = added_token_strings(tokenizer)
    start = first_special_start(after, specials)
    if start < len(after):
        end = start + max(len(s) for s in specials if after.startswith(s, start))
        return after[:end]
    newline = after.find("\n")
    return after[:newline + 1] if newline >= 0 else "\n"


def render_plain(task, text: str) -> str:
    blocks = [task.system_text()]
    for example, answer in task.example_turns():
        blocks.append(f"{task.render_suffix(example)}\n{PLAIN_ANSWER_LEAD} {answer}")
    blocks.append(f"{task.render_suffix(text)}\n{PLAIN_ANSWER_LEAD}")
    return "\n\n".join(blocks)


def added_token_strings(tokenizer, *, special_only: bool = False) -> list[str]:
    """The added tokens' strings, longest first (where a tokenizer splits text before its
    model runs); `special_only`: only the special ones (control tokens)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted({t.content for t in decoder.values() if t.content and (t.special or not special_only)},
                  key=len, reverse=True)


def last_special_end(s: str, specials: Sequence[str]) -> int:
    end = 0
    for tok in specials:
        i = s.rfind(tok)
        if i >= 0:
            end = max(end, i + len(tok))
    return end


def first_special_start(s: str, specials: Sequence[str]) -> int:
    start = len(s)
    for tok in specials:
        i = s.find(tok)
        if i >= 0:
            start = min(start, i)
    return start
