"""What a process that starts other processes needs: a free TCP port for their rendezvous,
and a wait on a multiprocessing queue that notices when they die."""
import socket
import time
from queue import Empty


class ProcessExited(RuntimeError):
    """A process that was expected to report on a queue exited first."""

    def __init__(self, process):
        super().__init__(f"process {process.name} exited with code {process.exitcode}")
        self.process = process


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_from(queue, processes: list, deadline: float, poll_s: float, exit_ok: bool = False):
    """The next item on ``queue``, which ``processes`` put there. Between polls (every
    ``poll_s`` seconds) it fails fast rather than waiting for a message that cannot come:
    ``ProcessExited`` when one of the processes has exited (with ``exit_ok``, only with a
    non-zero code: a process may exit cleanly once it has put its result), ``TimeoutError``
    past ``deadline`` (a ``time.monotonic()`` value)."""
    while True:
        try:
            return queue.get(timeout=poll_s)
        except Empty:
            dead = [p for p in processes if p.exitcode is not None and not (exit_ok and p.exitcode == 0)]
            if dead:
                raise ProcessExited(dead[0]) from None
            if time.monotonic() > deadline:
                raise TimeoutError("nothing arrived on the queue within the deadline") from None
