"""A fair share of the grammar compiler for each client.

The compiler runs ``COMPILE_THREADS`` compiles at once, each up to ``COMPILE_TIMEOUT_S``
(``minivllm.structured.compiler``), and queues the rest in order. So a client that sends a
few grammars that take the whole limit to compile (a JSON schema whose ``pattern`` is
``^.{0,5000}$`` is 200 bytes) would hold every compile thread, and every other client's new
grammar would wait behind them. ``CompileGate`` lets each client (each peer address) have
``per_client`` compiles in flight, one by default: its next ones wait for its own, so they
delay only itself, and a new schema from anyone else finds a compile thread free. A compile
counts until it ends, even if its client hung up (the compile goes on for the cache). A
grammar that waits past ``wait_s`` for its turn is refused (429): the client has that many
compiles queued. A grammar already compiled (in the cache) passes without waiting.
"""
import asyncio
from collections import Counter

from minivllm.server.protocol import APIError

COMPILES_PER_CLIENT = 1  # one fewer than the compiler's threads: someone else always finds one free
COMPILE_WAIT_S = 30.0  # a grammar waiting longer for its client's turn is refused


class CompileGate:
    """Per-client turns for grammar compiles (see the module's docstring)."""

    def __init__(self, per_client: int = COMPILES_PER_CLIENT, wait_s: float = COMPILE_WAIT_S):
        self.per_client, self.wait_s = per_client, wait_s
        self.turns: dict[str, asyncio.Semaphore] = {}  # client -> its turns (dropped when nobody uses them)
        self.users: Counter = Counter()  # client -> compiles running or waiting

    async def compile(self, client: str, compile_grammar) -> None:
        """Run ``compile_grammar()`` (a coroutine function) in ``client``'s turn; APIError(429)
        when the turn does not come within ``wait_s``."""
        turns = self.turns.setdefault(client, asyncio.Semaphore(self.per_client))
        self.users[client] += 1
        try:
            await asyncio.wait_for(turns.acquire(), self.wait_s)
        except TimeoutError:
            self._leave(client)
            raise APIError(429, f"structured output: this client's earlier grammars are still compiling (one at a "
                                f"time per client); this one waited {self.wait_s:g} s for its turn: try again later",
                           type="rate_limit_error", code="grammar_queue_full") from None
        except BaseException:
            self._leave(client)
            raise
        # The turn is held until the compile ends, not until this caller stops waiting: a
        # client that hangs up does not get its turn back while its compile goes on.
        task = asyncio.ensure_future(compile_grammar())
        task.add_done_callback(lambda _: (turns.release(), self._leave(client)))
        await asyncio.shield(task)

    def _leave(self, client: str) -> None:
        self.users[client] -= 1
        if not self.users[client]:
            del self.users[client], self.turns[client]
