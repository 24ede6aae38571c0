# Exercise copy of minivllm/spec_decode/ngram.py, generated from it by scripts/make_exercises.py.
# Fill in: propose_ngram (ch19).
# Grade: make grade CH=19
# Running the generator again overwrites this file: commit or copy your work first.

"""N-gram (prompt lookup) speculation: guess the next tokens by copying what followed the
last time the sequence's most recent tokens appeared.

Text repeats itself: code quotes the identifiers it defined, a summary quotes its source,
an answer repeats the question. If the last n tokens of a sequence occurred before in its
prompt or output, the k tokens that followed that occurrence are a free guess at what
comes next. The guess costs no model at all (a scan of the token list on the host); the
target model then checks all k guesses in one forward pass (``minivllm.spec_decode.verify``),
so every accepted guess is a token for which no decode step had to run.

We look for the longest suffix first (n = prompt_lookup_max down to prompt_lookup_min): a
longer match is better evidence. Among occurrences of that suffix, the most recent wins:
the text nearby is the best predictor of what comes next.
"""
import numpy as np


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """At most k draft tokens for the sequence ``token_ids``: the tokens that followed the
    most recent earlier occurrence of its last n tokens, for the largest n in
    [min_n, max_n] that occurs earlier; [] if none does. Fewer than k when the occurrence is
    close to the end of the list (what followed it may overlap the suffix itself: in
    "a a a a" the suffix "a a a" occurred at 0 and was followed by one "a")."""
    if k < 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):  # the longest suffix first
        raise NotImplementedError(
            "ch19: ngram_lookup (for this n): prompt lookup: find an earlier place where the last "
            "n tokens occurred and propose what followed. Compare the suffix with every window of "
            "n tokens that starts before the suffix does (the suffix must not match itself; "
            "overlapping it is fine); of several matches take the most recent, and return at most "
            "k tokens that follow it, as a list of ints. With no match, fall through to the next "
            "shorter n, see notebooks/19_speculative_decoding.ipynb"
        )
    return []
