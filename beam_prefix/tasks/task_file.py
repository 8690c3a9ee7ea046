"""Reading a task file: YAML, safely and within bounds, whatever kind of task it holds.

`read_task_file` reads at most `MAX_TASK_FILE_BYTES`, with a safe loader that refuses
anchors and aliases (no "billion laughs") and duplicate keys (YAML lets the last one win
silently), and refuses a document nested deeper than `MAX_TASK_DEPTH` (later checks, and
their messages, recurse). Every problem is a `TaskSpecError` naming the file.
"""

from __future__ import annotations

from typing import Any, Mapping

import re
import unicodedata

import yaml

from beam_prefix.errors import TaskSpecError

__all__ = ["read_task_file", "nesting_depth", "file_name_of", "refuse_invisible", "refuse_lookalikes",
           "MAX_TASK_FILE_BYTES", "MAX_TASK_DEPTH"]

MAX_TASK_FILE_BYTES = 4 * 1024 * 1024  # far above any prompt a small model's context holds
MAX_TASK_DEPTH = 32  # a task file nests 4 levels (fields -> a field -> values -> a value); YAML allows thousands


def read_task_file(path: str) -> Any:
    """The parsed YAML document of a task file, of any kind (bounded, no aliases or duplicate keys)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TASK_FILE_BYTES + 1)
    except OSError as e:
        raise TaskSpecError(f"task file {path!r} cannot be read: {e}") from e
    if len(raw) > MAX_TASK_FILE_BYTES:
        raise TaskSpecError(f"task file {path!r} is larger than {MAX_TASK_FILE_BYTES:,} bytes")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_TaskLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as e:
        raise TaskSpecError(f"task file {path!r} is not UTF-8: {e}") from None
    except yaml.YAMLError as e:
        raise TaskSpecError(f"task file {path!r} is not valid YAML: {_cut(str(e), 500)}") from None
    except RecursionError:  # the YAML composer recurses once per level
        raise TaskSpecError(f"task file {path!r} is nested too deeply (at most {MAX_TASK_DEPTH} levels)") from None
    if nesting_depth(data, MAX_TASK_DEPTH) > MAX_TASK_DEPTH:  # later checks (and their messages) recurse too
        raise TaskSpecError(f"task file {path!r} is nested too deeply (at most {MAX_TASK_DEPTH} levels)")
    return data


_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def file_name_of(name: str, what: str = "task name") -> str:
    """`name` (a task's name) where it becomes a file name (a tuned directory's
    ``<name>.head``): letters, digits, ``.``, ``_`` and ``-``, at most 100, never a path.

    Raises:
        TaskSpecError: naming the name and what it may hold.
    """
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name:
        raise TaskSpecError(f"{what} {name!r} is not a file name (it names this run's files): use letters, digits, "
                            f"'.', '_' and '-' (at most 100, starting with a letter or digit, no '..')")
    return name


def nesting_depth(data: Any, limit: int) -> int:
    """How deeply lists and mappings nest in `data`, counted up to ``limit + 1``
    (iteratively: a value nested past Python's recursion limit is measured too)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, Mapping):
            children = list(value.keys()) + list(value.values())
        elif isinstance(value, (list, tuple)):
            children = list(value)
        else:
            continue
        deepest = max(deepest, level)
        if level <= limit:  # past the limit the answer is known
            stack.extend((child, level + 1) for child in children)
    return deepest


_STR = "tag:yaml.org,2002:str"


def _labels_as_text(root) -> None:
    """Read every scalar of the document's ``labels`` (names and descriptions) and every
    example's ``label`` as the text the user wrote: YAML 1.1 reads ``yes``/``no``,
    ``on``/``off`` and ``true``/``false`` as booleans (and ``1.0`` as a number), and a task
    whose labels are ``yes``/``no`` would fail to load."""
    if not isinstance(root, yaml.MappingNode):
        return
    for key, value in root.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        if key.value == "labels" and isinstance(value, yaml.SequenceNode):
            for item in value.value:
                if isinstance(item, yaml.ScalarNode):
                    item.tag = _STR
                elif isinstance(item, yaml.MappingNode):
                    _fields_as_text(item, ("name", "description"))
        elif key.value == "examples" and isinstance(value, yaml.SequenceNode):
            for item in value.value:
                if isinstance(item, yaml.MappingNode):
                    _fields_as_text(item, ("label",))


def _fields_as_text(mapping, names) -> None:
    for key, value in mapping.value:
        if isinstance(key, yaml.ScalarNode) and key.value in names and isinstance(value, yaml.ScalarNode):
            value.tag = _STR


class _TaskLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` without aliases (an alias bomb expands to gigabytes) and without
    duplicate keys (YAML lets the last one win silently), whose labels stay text
    (`_labels_as_text`)."""

    def construct_document(self, node):
        _labels_as_text(node)
        return super().construct_document(node)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, f"anchors and aliases (*{event.anchor}) are not allowed in task files", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


# characters a reader cannot see or that change how text around them shows: control and
# format characters (zero-width spaces and joiners, U+202E right-to-left override, ...), line
# and paragraph separators, surrogates and private-use code points
_INVISIBLE = ("Cc", "Cf", "Cs", "Co", "Zl", "Zp")


def refuse_invisible(name: str, what: str) -> None:
    """Refuse a label or value `name` holding a character no reader sees as written (a
    filter on ``label == 'billing'`` would miss ``billing\\u200b``).

    Raises:
        TaskSpecError: naming `what`, the name and the character's code point and name.
    """
    for ch in name:
        if unicodedata.category(ch) in _INVISIBLE:
            raise TaskSpecError(f"{what} {name!r} holds the invisible or control character U+{ord(ch):04X} "
                                f"({unicodedata.name(ch, unicodedata.category(ch))}); write it with visible "
                                f"characters only")


def refuse_lookalikes(names, what: str) -> None:
    """Refuse two names of `names` that are one after Unicode normalisation (NFKC: a
    full-width ``ｂｉｌｌｉｎｇ`` is ``billing``), naming both.

    Raises:
        TaskSpecError: naming `what` and the two names.
    """
    seen: dict[str, str] = {}
    for name in names:
        key = unicodedata.normalize("NFKC", name)
        if key in seen and seen[key] != name:
            raise TaskSpecError(f"{what} {seen[key]!r} and {name!r} are the same text after Unicode normalisation "
                                f"(NFKC): a reader cannot tell them apart; keep one")
        seen.setdefault(key, name)
