"""Chapter 18 — structured output: a token bitmask applied to logits, and a choice
constraint over a token trie.

Your ``unpack_bitmask`` (exercises/minivllm/ops/token_bitmask.py) is checked bit by bit on
random int32 words (negative ones included: the sign bit is token 31 of its word), for
vocabularies that end mid-word, and through ``apply_token_bitmask_reference``, which must set
exactly the disallowed logits to -inf and leave the others untouched. Your ``allowed_tokens``
(exercises/minivllm/structured/trie.py) is checked on a hand-made vocabulary, against a brute
force over every token of random vocabularies and choices, and against the mask xgrammar's
matcher computes for the same choice on the bundled model's real vocabulary.
"""
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.ops.token_bitmask import apply_token_bitmask_reference, unpack_bitmask
from minivllm.structured.trie import ChoiceConstraint, allowed_tokens, build_trie, walk


def bit_by_bit(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for t in range(vocab):
            out[r, t] = bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)
    return out


def test_unpack_by_hand():
    bitmask = torch.tensor([[0b101, -1], [0, -2**31]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.shape == (2, 40) and allowed.dtype == torch.bool
    assert allowed[0].nonzero().flatten().tolist() == [0, 2] + list(range(32, 40))
    assert allowed[1].nonzero().flatten().tolist() == []  # bit 31 of word 1 is token 63: past the vocabulary
    assert unpack_bitmask(bitmask, 64)[1].nonzero().flatten().tolist() == [63]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 200), seed=st.integers(0, 2**31))
def test_unpack_matches_bit_by_bit(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2**31, 2**31, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(unpack_bitmask(bitmask, vocab), bit_by_bit(bitmask, vocab))


def test_apply_sets_exactly_the_disallowed_logits_to_minus_inf():
    g = torch.Generator().manual_seed(1)
    rows, vocab = 5, 1000
    bitmask = torch.randint(-2**31, 2**31, (rows, 32), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[2] = -1  # a row without a grammar
    logits = torch.randn(rows, vocab, generator=g)
    out = apply_token_bitmask_reference(logits.clone(), bitmask)
    allowed = bit_by_bit(bitmask, vocab)
    assert torch.equal(out[allowed], logits[allowed])
    assert bool((out[~allowed] == float("-inf")).all())
    assert torch.equal(out[2], logits[2])


def test_allowed_tokens_by_hand():
    vocab = [b"a", b"b", b"ab", b"abc", b"bc", b"c", b"ca"]
    vocab_trie = build_trie(vocab, list(range(len(vocab))))
    choices = build_trie([b"abc", b"bca"])
    assert allowed_tokens(choices, vocab_trie) == [0, 1, 2, 3, 4]  # a, b, ab, abc, bc; not c, ca
    assert allowed_tokens(walk(choices, b"b"), vocab_trie) == [5, 6]  # c, ca (the rest of "bca")
    assert allowed_tokens(walk(choices, b"abc"), vocab_trie) == []


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_allowed_tokens_match_brute_force(seed):
    rng = random.Random(seed)
    letters = b"abc "
    vocab = list({bytes(rng.choice(letters) for _ in range(rng.randint(1, 4))) for _ in range(40)})
    choices = [bytes(rng.choice(letters) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 4))]
    vocab_trie, choice_trie = build_trie(vocab, list(range(len(vocab)))), build_trie(choices)
    for prefix in {c[:k] for c in choices for k in range(len(c) + 1)}:
        expected = sorted(t for t, s in enumerate(vocab) if any(c.startswith(prefix + s) for c in choices))
        assert allowed_tokens(walk(choice_trie, prefix), vocab_trie) == expected


def test_choice_constraint_agrees_with_xgrammar_on_the_bundled_vocabulary():
    from minivllm import LLM
    from minivllm.structured import StructuredOutputsParams
    from minivllm.structured.matcher import GrammarState, fill_bitmask
    from minivllm.structured.trie import vocab_bytes

    llm = LLM()
    tokenizer, size = llm.get_tokenizer(), llm.engine.runner.model_config.vocab_size
    choices = ["yes", "no", "not sure", "maybe"]
    vocab = vocab_bytes(tokenizer, size)
    by_hand = ChoiceConstraint(choices, vocab, stop_token_id=0)
    state = GrammarState(llm.engine.grammar_compiler().compile(StructuredOutputsParams(choice=choices)))
    generated = b""
    for token in tokenizer.encode("not sure", add_special_tokens=False) + [0]:
        assert torch.equal(by_hand.mask(generated), unpack_bitmask(fill_bitmask([state], size), size)[0])
        assert state.accept(token)
        generated += vocab[token]


# --- the choice constraint, whole: tries, walk, mask -------------------------------------


def test_ch18_build_trie_shares_prefixes_and_keeps_every_id():
    root = build_trie([b"ab", b"a", b"ab", b"", b"b"], [10, 11, 12, 13, 14])
    assert sorted(root.children) == [ord("a"), ord("b")], "one child per first byte: prefixes are shared"
    a = root.children[ord("a")]
    assert a.is_end and a.token_ids == [11], "a string's last node is an end and keeps its id"
    ab = a.children[ord("b")]
    assert ab.is_end and ab.token_ids == [10, 12], "two tokens that spell the same bytes are both kept, in order"
    assert not root.is_end and root.token_ids == [], "an empty string spells nothing: the root stays no end"
    plain = build_trie([b"xy"])
    node = plain.children[ord("x")]
    assert not node.is_end and node.children[ord("y")].is_end, "only the node where a string ends is an end"
    assert node.children[ord("y")].token_ids == [], "without token_ids no id is recorded"


def test_ch18_walk_follows_bytes_and_falls_off():
    root = build_trie([b"abc"])
    assert walk(root, b"") is root, "no bytes: stay where you are"
    assert walk(root, b"ab") is root.children[ord("a")].children[ord("b")], "each byte one child down"
    assert walk(root, b"abd") is None, "a byte with no child leaves the trie: None"
    assert walk(root, b"abcd") is None, "past the end: None"
    assert walk(None, b"a") is None, "from outside the trie, still outside"


def test_ch18_choice_constraint_allows_the_stop_token_only_at_a_whole_choice():
    vocab = [b"<s>", b"y", b"ye", b"yes", b"s", b"n", b"no", b"o", b""]
    c = ChoiceConstraint(["yes", "no", "yesno"], vocab, stop_token_id=0)
    assert c.allowed(b"") == [1, 2, 3, 5, 6], "at the start: every token that starts a choice (not the empty one)"
    assert c.allowed(b"ye") == [4], "inside a choice: only what continues it"
    assert sorted(c.allowed(b"yes")) == [0, 5, 6], "a whole choice that may go on: its continuations and the stop token"
    assert c.allowed(b"no") == [0], "a whole choice that ends: only the stop token"
    assert c.allowed(b"x") == [], "an output that left every choice allows nothing"
    mask = c.mask(b"yes")
    assert mask.dtype == torch.bool and mask.shape == (len(vocab),), "the mask: [vocab] booleans"
    assert mask.nonzero().flatten().tolist() == [0, 5, 6], "True exactly at the allowed tokens"
    assert not c.mask(b"x").any(), "nothing allowed: an all-False mask"
