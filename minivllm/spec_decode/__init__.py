"""Speculative decoding (chapter 19): propose a few tokens cheaply, verify them all in one
forward pass of the target model. See ``ngram`` for the proposer and ``verify`` for the
acceptance rule."""
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.ngram import propose_ngram
from minivllm.spec_decode.verify import num_accepted

__all__ = ["SpeculativeConfig", "propose_ngram", "num_accepted"]
