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
    # BEGIN SOLUTION ch18 build_trie
    root = TrieNode()
    for i, s in enumerate(strings):
        if not s:
            continue  # special tokens spell nothing here
        node = root
        for b in s:
            node = node.children.setdefault(b, TrieNode())
        node.is_end = True
        if token_ids is not None:
            node.token_ids.append(token_ids[i])
    return root
    # END SOLUTION


def walk(node: TrieNode | None, data: bytes) -> TrieNode | None:
    """The node ``data`` leads to from ``node``, or None if it leaves the trie."""
    # BEGIN SOLUTION ch18 walk
    for b in data:
        if node is None:
            return None
        node = node.children.get(b)
    return node
    # END SOLUTION


def allowed_tokens(choice_node: TrieNode, vocab_trie: TrieNode) -> list[int]:
    """The tokens whose whole spelling continues a path of the choice trie from ``choice_node``."""
    # BEGIN SOLUTION ch18 allowed_tokens
    allowed = []
    stack = [(choice_node, vocab_trie)]
    while stack:
        choice, vocab = stack.pop()
        for byte, vocab_child in vocab.children.items():
            choice_child = choice.children.get(byte)
            if choice_child is None:
                continue  # a token spelling this byte here would leave every choice
            allowed += vocab_child.token_ids
            stack.append((choice_child, vocab_child))
    return sorted(allowed)
    # END SOLUTION


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
        # BEGIN SOLUTION ch18 choice_allowed
        node = walk(self.choices, generated)
        if node is None:
            return []  # the output has already left every choice
        return allowed_tokens(node, self.vocab) + ([self.stop_token_id] if node.is_end else [])
        # END SOLUTION

    def mask(self, generated: bytes) -> torch.Tensor:
        """[vocab] bool: True where a token may come next."""
        # BEGIN SOLUTION ch18 choice_mask
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.allowed(generated)] = True
        return mask
        # END SOLUTION
