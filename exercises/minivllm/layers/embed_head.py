# Exercise copy of minivllm/layers/embed_head.py, generated from it by scripts/make_exercises.py.
# Fill in: masked_embedding (ch16), ScaledVocabEmbedding.forward (ch11).
# Grade: make grade CH=11; make grade CH=16
# Running the generator again overwrites this file: commit or copy your work first.

"""Token embedding and the language-model head, split by vocabulary under tensor parallelism.

Each rank keeps a contiguous slice of the vocabulary's rows (rank r: rows
[r * n, (r + 1) * n), n = vocab_size / world_size rounded up; the last slice is padded with
zero rows when the vocabulary does not divide). The embedding looks up only the tokens in
its slice, zeros for the others, and an all-reduce adds the one real row to the zeros. The
head scores only its slice of the vocabulary, and an all-gather puts the slices side by
side. At world size 1 the slice is the whole vocabulary.
"""
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.context import get_context
from minivllm.distributed.parallel_state import all_gather, all_reduce, get_tp_rank, get_tp_world_size


def masked_embedding(input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Look up the ids that fall in this rank's rows [vocab_start, vocab_start + len(weight));
    every other id gets a zero vector (another rank holds its row)."""
    raise NotImplementedError(
        "ch16: masked_embedding: this rank holds the embedding rows of the slice of the vocabulary "
        "that starts at vocab_start (weight has one row per id of the slice). Shift every token id "
        "into the slice and look it up locally; a token outside the slice must neither index out "
        "of range (give it any valid local id) nor contribute anything but a zero row, so that the "
        "sum over the ranks (the all-reduce) gives each token exactly its one row. Pitfall: ids "
        "past the slice's end are outside too, not only the negative ones, see "
        "notebooks/16_tensor_parallelism.ipynb"
    )


def vocab_slice(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first row, rows per rank) of the vocabulary that ``rank`` keeps; the last rank's
    slice runs past the vocabulary when it does not divide (padding rows)."""
    rows_per_rank = -(-vocab_size // world_size)  # rounded up
    return rank * rows_per_rank, rows_per_rank


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tp_size = get_tp_world_size()
        self.vocab_start, self.rows_per_rank = vocab_slice(vocab_size, get_tp_rank(), self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Keep this rank's rows of the full [vocab_size, hidden_size] matrix; zero the padding."""
        expected = (self.vocab_size, self.hidden_size)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expected shape {expected}, got {tuple(loaded_weight.shape)}")
        rows = loaded_weight[self.vocab_start : self.vocab_start + self.rows_per_rank]
        param.data[: len(rows)].copy_(rows)
        param.data[len(rows) :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        return all_reduce(masked_embedding(input_ids, self.weight, self.vocab_start))


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits.

    With tied embeddings the head reuses the embedding matrix (``tie_to``): one tensor,
    two uses, and the checkpoint stores it once. Split by vocabulary the same way, so a
    tied head reuses this rank's embedding rows.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tp_size = get_tp_world_size()
        self.vocab_start, self.rows_per_rank = vocab_slice(vocab_size, get_tp_rank(), self.tp_size)
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
            self.weight.weight_loader = self.weight_loader

    # The same rows of the same kind of matrix as the embedding's.
    weight_loader = VocabEmbedding.weight_loader

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        # Each rank scored its slice of the vocabulary: side by side, without the padding.
        return all_gather(logits, dim=-1)[..., : self.vocab_size]


def lm_heads(model: nn.Module) -> list[LMHead]:
    """Every LM head of a model (one, or none in a bare backbone), in order."""
    return [m for m in model.modules() if isinstance(m, LMHead)]


def last_token_states(hidden_states: torch.Tensor) -> torch.Tensor:
    """Only each sequence's last token predicts the next one: keep those rows.
    (In a pure decode step every row already is one.)"""
    ctx = get_context()
    if ctx.logits_indices is not None:  # only some sequences sample this step
        return hidden_states[ctx.logits_indices]
    if ctx.cu_seqlens_q is None:
        return hidden_states[-1:]
    if not ctx.is_prefill:
        return hidden_states
    return hidden_states[ctx.cu_seqlens_q[1:].long() - 1]


class ScaledVocabEmbedding(VocabEmbedding):
    """Embeddings times sqrt(hidden_size); the factor is cast to the weights' dtype first."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.scale = hidden_size**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Rounded on the host to the weights' dtype, then used as a Python number: no
        # host-to-device copy, so the step can be captured in a CUDA graph.
        raise NotImplementedError(
            "ch11: scaled embeddings: Gemma multiplies each embedding row by the square root of "
            "the hidden size. transformers rounds that factor to the weights' dtype before "
            "multiplying, and so must you (in bfloat16, 45.25 is not sqrt(2048)). Keep the factor "
            "a Python number, not a tensor on the device, so a CUDA graph can capture the step, "
            "see notebooks/11_model_families.ipynb"
        )
