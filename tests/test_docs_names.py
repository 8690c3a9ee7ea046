"""Every example names what exists (#63): the task names and task files in every code block
(run or not-run), the keywords of every Python example against the signature it calls,
and the `ClassifyText` signature docs/beam.md spells out against the constructor."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from conftest import ROOT
from test_docs_blocks import BLOCKS

# where a block names a task: a flag, a keyword, a loader's first argument, a YAML/JSON key
TASK_REFERENCES = [
    re.compile(r"""--task[= ]['"]?([^\s'"\\]+)"""),
    re.compile(r"""\btask\s*=\s*["']([^"']+)["']"""),
    re.compile(r"""(?:from_yaml|load_task|PrefixClassifier\.load|Extractor\.load|resolve_task)\(\s*["']([^"']+)["']"""),
    re.compile(r"""["'](?:task|classify_task|support_task|extract_task)["']\s*:\s*["']([^"']+)["']"""),
    re.compile(r"""^\s*(?:task|classify_task|extract_task)\s*:\s*["']?([^\s"'#]+)""", re.M),
]
# how a page creates a file that a later command reads as its task
WRITES = r"(?:>\s*|--output[= ]|open\(\s*[\"'])"
CODE = ("python", "bash", "yaml", "sh")


def _task_references():
    found = []
    for page, line, lang, code, mark, _ in BLOCKS:
        if lang not in CODE:
            continue
        for pattern in TASK_REFERENCES:
            for m in pattern.finditer(code):
                found.append(pytest.param(page, line, m.group(1), id=f"{page}:{line}:{m.group(1)}"))
    return found


def _written_by(page: str, path: str) -> bool:
    """Whether a block of `page` writes `path` (a redirect, an --output, an open for writing)."""
    return any(p == page and re.search(WRITES + re.escape(path), code) for p, _, _, code, _, _ in BLOCKS)


def test_blocks_name_tasks_at_all():
    assert len(_task_references()) >= 20  # (the patterns still find the pages' task references)


@pytest.mark.parametrize("page, line, name", _task_references())
def test_every_task_a_block_names_is_shipped_or_exists(page, line, name):
    from beam_prefix.tasks.shipped import SHIPPED_TASKS

    if name in SHIPPED_TASKS:
        return
    assert not name.startswith("gs://"), f"{page}:{line}: {name}: examples name shipped tasks or local files"
    assert name.endswith((".yaml", ".yml")), f"{page}:{line}: {name!r} is neither a shipped task nor a task file " \
                                             f"(shipped: {sorted(SHIPPED_TASKS)})"
    assert (ROOT / name).is_file() or _written_by(page, name), \
        f"{page}:{line}: {name} does not exist in the checkout and no block of the page writes it"


def _api():
    """The public callables examples call, by the name a call spells (a method: its class's)."""
    from beam_prefix import Extractor, PrefixClassifier, TaskSpec, fit_head, stage_embedded_model, tune_model
    from beam_prefix.beam.handler import KeyedPrefixCachedModelHandler, PrefixCachedModelHandler
    from beam_prefix.embed_transform import EmbedText
    from beam_prefix.extract_transform import ExtractFields
    from beam_prefix.transforms import ClassifyText

    return {"ClassifyText": [ClassifyText], "ExtractFields": [ExtractFields], "EmbedText": [EmbedText],
            "PrefixCachedModelHandler": [PrefixCachedModelHandler],
            "KeyedPrefixCachedModelHandler": [KeyedPrefixCachedModelHandler, PrefixCachedModelHandler],
            "PrefixClassifier": [PrefixClassifier], "fit_head": [fit_head], "tune_model": [tune_model],
            "stage_embedded_model": [stage_embedded_model],
            "PrefixClassifier.load": [PrefixClassifier.load], "Extractor.load": [Extractor.load],
            "TaskSpec.from_yaml": [TaskSpec.from_yaml], "embed": [PrefixClassifier.embed],
            "classify": [PrefixClassifier.classify], "replace": [TaskSpec.replace]}


def _called(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        owner = f.value.id if isinstance(f.value, ast.Name) else None
        return f"{owner}.{f.attr}" if owner in ("PrefixClassifier", "Extractor", "TaskSpec") else f.attr
    return None


def _python_calls():
    calls = []
    for page, line, lang, code, _, _ in BLOCKS:
        if lang != "python":
            continue
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Call) and (name := _called(node)):
                calls.append((page, line, name, [k.arg for k in node.keywords if k.arg]))
    return calls


def test_every_keyword_a_python_example_passes_is_a_parameter():
    api, checked = _api(), 0
    for page, line, name, keywords in _python_calls():
        if name not in api or not keywords:
            continue
        params = set()
        if name == "replace":  # TaskSpec.replace(**changes): the task's fields
            import dataclasses

            from beam_prefix import TaskSpec
            params = {f.name for f in dataclasses.fields(TaskSpec)}
        for target in [] if params else api[name]:
            sig = inspect.signature(target)
            if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) and target is api[name][-1] \
                    and len(api[name]) == 1:
                params = None  # (takes any keyword: nothing to check)
                break
            params |= set(sig.parameters)
        if params is None:
            continue
        unknown = [k for k in keywords if k not in params]
        assert not unknown, f"{page}:{line}: {name}() has no parameter {unknown}"
        checked += 1
    assert checked >= 10


def test_the_classify_text_signature_beam_md_spells_out_is_the_constructors():
    from beam_prefix.transforms import ClassifyText

    text = (ROOT / "docs" / "beam.md").read_text(encoding="utf-8")
    shown = re.search(r"`(ClassifyText\(task=.*?\))`", text, re.S).group(1)
    parts, star = [], False
    for name, p in list(inspect.signature(ClassifyText.__init__).parameters.items())[1:]:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(name if p.default is p.empty else f"{name}={p.default!r}".replace("'", '"'))
    assert " ".join(shown.split()) == f"ClassifyText({', '.join(parts)})"
