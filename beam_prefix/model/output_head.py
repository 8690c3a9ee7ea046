"""`OutputHead`: the language-model head, computed only where an answer needs it.

Scoring never computes full-vocabulary logits for every position: label scoring needs the
logits of a few tokens (a label's first token, a trie edge) and a log-sum-exp over the
vocabulary at a few positions; decoding needs the logits of the tokens a schema allows.
Weights are the model's own (tied or not), with its final-logit scaling and soft-capping.
"""

from __future__ import annotations

import torch

__all__ = ["OutputHead"]


class OutputHead:
    """The LM head restricted to what scoring needs (weights shared with the model)."""

    def __init__(self, model):
        head = model.get_output_embeddings()
        self.weight: torch.Tensor = head.weight  # [vocab, hidden]
        self.bias: torch.Tensor | None = getattr(head, "bias", None)
        config = model.config
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.scale = getattr(config, "logit_scale", None)

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def logits_for(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of `token_ids` only. hidden: ``[N, H]``; token_ids: ``[K]`` -> ``[N, K]``."""
        logits = hidden @ self.weight[token_ids].T
        if self.bias is not None:
            logits = logits + self.bias[token_ids]
        return self._finish(logits.float())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary. hidden: ``[N, H]`` -> ``[N, V]`` (fp32)."""
        logits = hidden @ self.weight.T
        if self.bias is not None:
            logits = logits + self.bias
        return self._finish(logits.float())

    def pair_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Logit of one token per row. hidden: ``[N, H]``; token_ids: ``[N]`` -> ``[N]``."""
        logits = (hidden * self.weight[token_ids]).sum(-1)
        if self.bias is not None:
            logits = logits + self.bias[token_ids]
        return self._finish(logits.float())

    def logsumexp(self, hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """log-sum-exp over the vocabulary, in chunks of rows. hidden: ``[N, H]`` -> ``[N]``."""
        out = []
        for start in range(0, hidden.shape[0], chunk):
            logits = hidden[start:start + chunk] @ self.weight.T
            if self.bias is not None:
                logits = logits + self.bias
            out.append(torch.logsumexp(self._finish(logits.float()), dim=-1))
        return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)
