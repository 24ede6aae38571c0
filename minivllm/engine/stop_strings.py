"""Stop strings found in a growing text, at a cost per character that does not depend on
how many stop strings a request has.

Checking each stop string against every new piece of text costs (number of stop strings)
per token, in the one thread that runs every request's steps: a request with 200,000 stop
strings would slow the whole batch. An Aho-Corasick automaton reads each new character
once: a trie of the stop strings, plus a *fail* link from each node to the longest proper
suffix of its string that is also in the trie, so a mismatch falls back instead of starting
over. A request keeps its state (a node) between tokens.

Which stop wins when several are in one piece of text: the one that ends first (it is the
first a character-by-character reader would see), and of those ending at the same place,
the longest. vLLM instead tries the stop strings in the order they were given.
"""
from collections import deque
from functools import lru_cache


class StopStrings:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        # The end of a text may be the start of a stop string that later text completes:
        # this many trailing characters are held back from a stream until that is ruled out.
        self.hold_back = max(map(len, stops)) - 1
        self.children: list[dict[str, int]] = [{}]
        word = [-1]  # node -> the stop string that is exactly its path, or -1
        for i, stop in enumerate(stops):
            node = 0
            for ch in stop:
                nxt = self.children[node].get(ch)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][ch] = nxt
                    self.children.append({})
                    word.append(-1)
                node = nxt
            if word[node] == -1:
                word[node] = i
        # Breadth first, so a node's fail target (shallower) is done before the node.
        self.fail = [0] * len(self.children)
        # node -> the longest stop string that is a suffix of the node's path, or -1
        self.match = list(word)
        queue = deque(self.children[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.children[node].items():
                f = self.fail[node]
                while f and ch not in self.children[f]:
                    f = self.fail[f]
                self.fail[child] = self.children[f].get(ch, 0)
                if self.match[child] == -1:
                    self.match[child] = self.match[self.fail[child]]
                queue.append(child)

    def feed(self, state: int, text: str, start: int, report: bool = True) -> tuple[int, int | None, str | None]:
        """Read ``text[start:]`` from automaton state ``state``. Returns the new state and,
        if a stop string ends in what was read (and ``report``), where it begins in ``text``
        and which it is (reading stops there)."""
        children, fail, match = self.children, self.fail, self.match
        for pos in range(start, len(text)):
            ch = text[pos]
            while state and ch not in children[state]:
                state = fail[state]
            state = children[state].get(ch, 0)
            if report and match[state] != -1:
                stop = self.stops[match[state]]
                return state, pos + 1 - len(stop), stop
        return state, None, None


@lru_cache(maxsize=256)
def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """One automaton per distinct list of stop strings (requests often share one)."""
    return StopStrings(stops)
