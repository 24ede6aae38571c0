"""What the kernel files share. No Triton import here: the ops read these on any machine."""
import torch

# The gated delta rule works in chunks of this many tokens: one tl.dot tile per chunk in
# kernels.gated_delta, and the torch reference (ops.gated_delta) chunks the same way.
CHUNK_SIZE = 64
# A prefill step whose sequences each compute at most this many tokens (speculative
# decoding's verifying steps, short prompts) runs the gated delta rule and its conv token by
# token, one launch per layer (kernels.gated_delta's short-step kernels): no chunk to build,
# no host-side loop, and a verify graph can capture it.
SHORT_STEP_TOKENS = 16

# Integer arguments that change from step to step (a row count, a block table's width, a
# number of splits) are ``do_not_specialize`` in their kernels: Triton would otherwise
# compile a variant for each value's divisibility by 16 (and for the value 1), in the middle
# of a user's run. Pointer arguments stay aligned instead (engine.step_inputs.FIELD_ALIGN).


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of every ``tl.dot``: float32 inputs get true float32 products (the
    course checks float32 token for token against transformers); half types use the tensor
    cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"
