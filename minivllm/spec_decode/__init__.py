"""Speculative decoding (chapter 19): propose a few tokens cheaply, verify them all in one
forward pass of the target model. See ``ngram``, ``draft`` and ``mtp`` for the proposers
(``proposer`` for what the engine asks of them) and ``verify`` for the acceptance rule.

Decoding is memory-bound: a decode step reads every weight to compute one token per
sequence, and computing 1 + d tokens per sequence reads them once too. If the proposer
guesses right a share of the time, each step yields more than one token for about the
price of one. The engine side (``spec_decode.feature.Speculation``, beside the step): a sequence
with d drafts is scheduled as a (1 + d)-token chunk over the paged cache, like a prefill
chunk; the sampler gets a row for each of its 1 + d positions; the accepted tokens go
through the ordinary append path one by one (stop strings, EOS, max_tokens, logprobs), and
the sequence's computed tokens and blocks are cut back past the rejected ones, whose KV
lies beyond its end and is overwritten later.

CUDA graphs: a verifying step has several tokens per sequence, so it is not a decode
step; on a GPU it replays a verify graph (``minivllm.engine.cuda_graphs``: per decode batch size,
each sequence at most 1 + k tokens, padded), and a draft model's whole proposal is one
graph too (``minivllm.spec_decode.proposal``). A hybrid model's verifying steps replay
verify graphs as well (their Gated DeltaNet layers run the short-step kernels, which read
the state slots on the device), where 1 + k is at most ``SHORT_STEP_TOKENS``; an MTP head's
passes run eagerly.

Limits: the engine runs the synchronous loop. The next step's inputs (each sequence's
positions, slots and tokens) depend on how many drafts this step accepts, and the n-gram
proposer reads the accepted tokens on the host; overlapping would mean preparing a step
before its shape is known. Measured (the bundled model on an H200, n-gram, k = 3, batch 1,
``scripts/profile_spec.py``): of a step's 1.27 ms the host's only part that does not wait
for the accepted tokens is taking them in, 0.08 ms; overlapping more needs the proposal and
the next step's inputs made on the device. Requests with penalties or bad words are not
speculated (each draft row would need its own token history); tensor parallelism, n > 1,
prompt_logprobs and structured outputs are refused.

Hybrid models (Gated DeltaNet layers) carry a recurrent state instead of a KV cache, and
it cannot be cut back as a block table is: the verifying step keeps the state after each
draft it computes, and the engine puts the one after the last accepted token back in the
sequence's slot (``minivllm.engine.state_pool``).
"""
from minivllm.config import SpeculativeConfig
from minivllm.spec_decode.ngram import propose_ngram
from minivllm.spec_decode.proposer import NgramProposer, make_proposer
from minivllm.spec_decode.verify import num_accepted

__all__ = ["SpeculativeConfig", "propose_ngram", "num_accepted", "NgramProposer", "make_proposer"]
