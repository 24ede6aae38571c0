"""Constrained decoding (chapter 18): a request's output is made to follow a grammar — a JSON
schema, a regular expression, a choice of strings, an EBNF grammar — by setting, before each
draw, the logits of every token that the grammar does not allow next to -inf.

    params.py    StructuredOutputsParams: what a request asks for (vLLM's names)
    trie.py      the idea by hand: a choice of strings over a token trie, and its token mask
    compiler.py  the real thing on xgrammar: grammars compiled once per spec and cached
    matcher.py   a matcher per sequence, and the batch's token bitmask
    tools.py     tool calls: what tools and tool_choice constrain, and the calls read back
                 (shared by LLM.chat and the server)

The mask itself is applied to the logits by ``minivllm.ops.token_bitmask`` (a Triton kernel
on the GPU). Only ``params`` is imported with the package: xgrammar is loaded when the
first constrained request arrives.
"""
from minivllm.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
