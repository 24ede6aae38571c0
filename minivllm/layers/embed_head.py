"""Token embedding and the language-model head."""
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.context import get_context
from minivllm.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight.weight_loader = lambda p, w, shard_id=None: default_weight_loader(p, w)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits.

    With tied embeddings the head reuses the embedding matrix (``tie_to``): one tensor,
    two uses, and the checkpoint stores it once.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None):
        super().__init__()
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
            self.weight.weight_loader = lambda p, w, shard_id=None: default_weight_loader(p, w)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight)


def last_token_states(hidden_states: torch.Tensor) -> torch.Tensor:
    """Only each sequence's last token predicts the next one: keep those rows.
    (In a pure decode step every row already is one.)"""
    ctx = get_context()
    if ctx.cu_seqlens_q is None:
        return hidden_states[-1:]
    if not ctx.is_prefill:
        return hidden_states
    return hidden_states[ctx.cu_seqlens_q[1:].long() - 1]
