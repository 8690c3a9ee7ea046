"""llama.cpp as a contender (L): the same GGUF weights, the same prompt token ids.

Needs llama-cpp-python (the `llama` extra: `pip install -e '.[llama]'`, built from source,
several minutes). Two paths, both scoring a row by its logits at the last prompt token:

- `OneRow`: the high-level `Llama` object, one row at a time over its kept prefix (what most
  users write): the prefix evaluated once, each row's suffix evaluated after it, the kept
  token count set back to the prefix before the next row.
- `Batched`: its best batched path through the low-level API: the prefix decoded once in
  sequence 0 of a unified KV cache, shared with B sequences by `llama_memory_seq_cp` (cells
  tagged, nothing copied), the B rows' suffixes in one `llama_batch` with logits only at each
  row's last token, then each row's sequence removed again (the prefix cells keep sequence 0).

`quantized(src, kind)` re-quantizes the GGUF with llama.cpp's own quantizer (F32, Q8_0,
Q4_0), cached next to the embedded model.
"""

from __future__ import annotations

import ctypes
import os
from typing import Sequence

KINDS = ("F32", "Q8_0", "Q4_0")


def available() -> str | None:
    """None when llama-cpp-python imports, else the line saying why L is skipped."""
    try:
        import llama_cpp  # noqa: F401 - only whether it imports
    except Exception as e:  # noqa: BLE001 - any import failure means: skip L
        return (f"llama.cpp contenders skipped: llama-cpp-python is not installed ({type(e).__name__}: {e}); "
                f"`make bench-peers` installs it (the `llama` extra, built from source)")
    return None


def _lib():
    import llama_cpp

    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_SILENT, ctypes.c_void_p())  # its logging (the quantizer's too) off the report
    return llama_cpp


def quantized(src: str, kind: str, cache_dir: str) -> str:
    """`src` re-quantized to `kind` by llama.cpp's quantizer (requantizing allowed), cached."""
    L = _lib()
    ftype = {"F32": L.LLAMA_FTYPE_ALL_F32, "Q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0,
             "Q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    os.makedirs(cache_dir, exist_ok=True)
    out = os.path.join(cache_dir, os.path.basename(src).rsplit(".", 2)[0] + f".{kind}.gguf")
    if not os.path.exists(out):
        params = L.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        tmp = out + ".part"
        if L.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src} to {kind}")
        os.replace(tmp, out)
    return out


class _Model:
    """One GGUF file loaded once: its vocabulary and tokenizer."""

    def __init__(self, path: str):
        L = _lib()
        self.path = path
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)

    def tokenize(self, text: str) -> tuple[int, ...]:
        """The prompt's ids by llama.cpp's own tokenizer (control strings parsed, no BOS added)."""
        L = _lib()
        data = text.encode("utf-8")
        buf = (L.llama_token * (len(data) + 8))()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, True)
        if n < 0:
            raise RuntimeError("llama.cpp tokenizer overflow")
        return tuple(buf[:n])


def _silent(level, text, user_data):  # keeps llama.cpp's per-call logging off the report
    return None


try:
    import llama_cpp as _llama_cpp

    _SILENT = _llama_cpp.llama_log_callback(_silent)
except Exception:  # noqa: BLE001 - not installed: nothing here is used
    _SILENT = None


def _context(model: _Model, *, n_ctx: int, n_batch: int, n_seq: int, threads: int, flash_attn: bool,
             ubatch: int | None = None):
    L = _lib()
    params = L.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    # the physical batch: llama.cpp splits a decode call into graphs of this many tokens
    params.n_ubatch = min(n_batch, ubatch or params.n_ubatch)
    params.n_seq_max = n_seq
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.kv_unified = True
    params.no_perf = True
    ctx = L.llama_init_from_model(model.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    return ctx


class _Batch:
    """A `llama_batch` the Python side fills: tokens, positions, one sequence id each."""

    def __init__(self, capacity: int):
        L = _lib()
        self.L, self.capacity = L, capacity
        self.batch = L.llama_batch_init(capacity, 0, 1)

    def fill(self, rows: Sequence[tuple[Sequence[int], int, int]]) -> list[int]:
        """`rows` of (ids, first position, sequence id); returns each row's last index."""
        b, at, lasts = self.batch, 0, []
        for ids, start, seq in rows:
            for j, tok in enumerate(ids):
                b.token[at] = tok
                b.pos[at] = start + j
                b.n_seq_id[at] = 1
                b.seq_id[at][0] = seq
                b.logits[at] = 0
                at += 1
            b.logits[at - 1] = 1
            lasts.append(at - 1)
        if at > self.capacity:
            raise RuntimeError("batch over capacity")
        b.n_tokens = at
        return lasts

    def __del__(self):
        self.L.llama_batch_free(self.batch)


def _scores(L, ctx, index: int, ids: Sequence[int]) -> list[float]:
    logits = L.llama_get_logits_ith(ctx, index)
    return [logits[i] for i in ids]


class Batched:
    """The prefix once, then B rows per `llama_decode` over the shared prefix cells."""

    def __init__(self, path: str, prefix_ids: Sequence[int], *, batch: int, max_suffix: int, threads: int,
                 flash_attn: bool, ubatch: int | None = None):
        L = self.L = _lib()
        self.model = _Model(path)
        self.prefix_len, self.batch_size = len(prefix_ids), batch
        self.ctx = _context(self.model, n_ctx=len(prefix_ids) + batch * max_suffix + 16,
                            n_batch=max(len(prefix_ids), batch * max_suffix), n_seq=batch + 1, threads=threads,
                            flash_attn=flash_attn, ubatch=ubatch)
        self.mem = L.llama_get_memory(self.ctx)
        self.buf = _Batch(max(len(prefix_ids), batch * max_suffix))
        self.buf.fill([(prefix_ids, 0, 0)])
        if L.llama_decode(self.ctx, self.buf.batch) != 0:
            raise RuntimeError("llama_decode failed on the prefix")

    def scores(self, suffixes: Sequence[Sequence[int]], label_ids: Sequence[int]) -> list[list[float]]:
        """Label-token logits at each row's last token, `batch` rows per decode."""
        L, out = self.L, []
        for start in range(0, len(suffixes), self.batch_size):
            chunk = suffixes[start:start + self.batch_size]
            seqs = range(1, len(chunk) + 1)
            for s in seqs:
                L.llama_memory_seq_cp(self.mem, 0, s, -1, -1)
            lasts = self.buf.fill([(ids, self.prefix_len, s) for ids, s in zip(chunk, seqs)])
            try:
                if L.llama_decode(self.ctx, self.buf.batch) != 0:
                    raise RuntimeError("llama_decode failed on a batch")
                out += [_scores(L, self.ctx, i, label_ids) for i in lasts]
            finally:
                for s in seqs:
                    L.llama_memory_seq_rm(self.mem, s, -1, -1)
        return out


class OneRow:
    """The high-level `Llama` object: one row at a time after its kept prefix."""

    def __init__(self, path: str, prefix_ids: Sequence[int], *, max_suffix: int, threads: int, flash_attn: bool):
        from llama_cpp import Llama

        self.L = _lib()
        self.llm = Llama(model_path=path, n_ctx=len(prefix_ids) + max_suffix + 16, n_batch=512,
                         n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn, verbose=False)
        self.llm.eval(list(prefix_ids))
        self.prefix_len = self.llm.n_tokens

    def scores(self, suffixes: Sequence[Sequence[int]], label_ids: Sequence[int]) -> list[list[float]]:
        out = []
        for ids in suffixes:
            self.llm.n_tokens = self.prefix_len  # eval() drops the cells after it first
            self.llm.eval(list(ids))
            out.append(_scores(self.L, self.llm.ctx, -1, label_ids))
        return out
