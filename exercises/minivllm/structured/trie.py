# Exercise copy of minivllm/structured/trie.py, generated from it by scripts/make_exercises.py.
# Fill in: build_trie (ch18), walk (ch18), allowed_tokens (ch18), ChoiceConstraint.allowed (ch18), ChoiceConstraint.mask (ch18).
# Grade: make grade CH=18
# Running the generator again overwrites this file: commit or copy your work first.

"""The idea by hand: a choice among strings, as a token mask (chapter 18).

A grammar speaks of characters (bytes); the model draws tokens, each of which spells several
bytes. A token may cover the end of one grammar symbol and the start of the next (``"}`` is
one token in many vocabularies), so "which tokens may come next" is not "which characters":
each token's whole spelling must fit the constraint from where the output stands.

For a choice among strings the question has a clean answer. Put the choices in a trie of
bytes; put the vocabulary in another. A token is allowed when its path in the vocabulary trie
is also a path in the choice trie from the current node. Walking both tries together visits
only the shared prefixes, never the whole vocabulary; the stop token is allowed when the output
is already one of the choices. xgrammar does the same for any grammar with a pushdown
automaton, precomputing most of the answer per automaton state.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class TrieNode:
    children: dict[int, "TrieNode"] = field(default_factory=dict)  # next byte -> node
    token_ids: list[int] = field(default_factory=list)  # the tokens that spell exactly this path
    is_end: bool = False  # a whole choice ends here


def build_trie(strings: list[bytes], token_ids: list[int] | None = None) -> TrieNode:
    """A byte trie of ``strings``; with ``token_ids``, each string's id is kept at its end."""
    raise NotImplementedError(
        "ch18: build_trie: one path of nodes per string, byte by byte from the root, sharing the "
        "nodes of common prefixes (reuse a child where it exists). Mark the node where a string "
        "ends as an end; with token_ids, also record there the id of that string (several tokens "
        "may spell the same bytes: keep them all). An empty string spells nothing: skip it (it "
        "must not mark the root as an end), see notebooks/18_structured_output.ipynb"
    )


def walk(node: TrieNode | None, data: bytes) -> TrieNode | None:
    """The node ``data`` leads to from ``node``, or None if it leaves the trie."""
    raise NotImplementedError(
        "ch18: walk: follow the bytes of data from node, child by child; the node reached, or None "
        "as soon as a byte has no child (or when node itself is None). An empty data stays where "
        "it is, see notebooks/18_structured_output.ipynb"
    )


def allowed_tokens(choice_node: TrieNode, vocab_trie: TrieNode) -> list[int]:
    """The tokens whose whole spelling continues a path of the choice trie from ``choice_node``."""
    raise NotImplementedError(
        "ch18: allowed_tokens: the tokens allowed next are those whose bytes, read from the "
        "current point of the choices (choice_node), stay on some choice's path. Walk the two "
        "tries together, from choice_node and the root of vocab_trie: a vocabulary node's child by "
        "a byte is worth following only if the choice node has a child by the same byte; each "
        "vocabulary child so reached ends the spelling of its tokens, which are allowed, and the "
        "two children are walked further. Use a stack of pairs (a recursion may run deep). Return "
        "the token ids sorted, see notebooks/18_structured_output.ipynb"
    )


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as a printable character (a space is "Ġ"):
    this maps those characters back to their bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    codes, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def vocab_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes (empty for special tokens and ids past the tokenizer's), for a
    byte-level BPE tokenizer such as the bundled model's."""
    decoder = byte_level_decoder()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = [b""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special and all(ch in decoder for ch in token):
            out[i] = bytes(decoder[ch] for ch in token)
    return out


class ChoiceConstraint:
    """Constrain an output to one of ``choices``: the mask of the tokens allowed after the
    bytes generated so far."""

    def __init__(self, choices: list[str], vocab: list[bytes], stop_token_id: int):
        self.choices = build_trie([c.encode() for c in choices])
        self.vocab = build_trie(vocab, list(range(len(vocab))))
        self.vocab_size = len(vocab)
        self.stop_token_id = stop_token_id

    def allowed(self, generated: bytes) -> list[int]:
        raise NotImplementedError(
            "ch18: ChoiceConstraint.allowed: the tokens that may follow the bytes generated so "
            "far. Find where those bytes lead in the choices' trie; an output that has left every "
            "choice allows nothing. Otherwise the tokens whose whole spelling stays on a choice's "
            "path from there, and the stop token too when a whole choice ends exactly there, see "
            "notebooks/18_structured_output.ipynb"
        )

    def mask(self, generated: bytes) -> torch.Tensor:
        """[vocab] bool: True where a token may come next."""
        raise NotImplementedError(
            "ch18: ChoiceConstraint.mask: the allowed tokens as a boolean mask over the "
            "vocabulary, True where a token may come next, see "
            "notebooks/18_structured_output.ipynb"
        )
