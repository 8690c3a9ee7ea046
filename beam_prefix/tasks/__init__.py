"""The task floor: what a task is and how it becomes tokens.

Task files (`task` for classification, `extract_task` for extraction, read by `task_file`),
a classification task's trained head file (`trained_head`), the prompt split into a cached
prefix and a per-row suffix at a token-clean boundary (`prompt`, rendered by
`prompt_render`), label token ids and their trie (`labels`), and a prompt's prefix cache
built on a loaded model (`cached_prompt`); the tasks shipped with the package, by name
(`shipped`). Imports only the model floor and `errors`.
"""

from beam_prefix.tasks.extract_task import ExtractExample, ExtractionSpec, Field, load_task
from beam_prefix.tasks.prompt import EncodedText, PromptLayout
from beam_prefix.tasks.shipped import shipped_tasks
from beam_prefix.tasks.task import Example, Label, PromptTask, TaskSpec
from beam_prefix.tasks.trained_head import TrainedHead

__all__ = ["TaskSpec", "Label", "Example", "PromptTask", "ExtractionSpec", "Field", "ExtractExample",
           "load_task", "shipped_tasks", "TrainedHead", "PromptLayout", "EncodedText"]
