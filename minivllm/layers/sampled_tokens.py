"""A step's sampled tokens on their way from the device to the host.

The sampler leaves its tokens on the device and queues their copy to pinned host memory right
behind the sampling: the next step can read them there without waiting (asynchronous
scheduling, chapter 17), and the host waits, in ``to_host``, for this step's work only.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (log-prob of the chosen token, its rank (1 = most likely), top-n token ids,
    # their log-probs), or None.
    logprobs: list[tuple[float, int, list[int], list[float]] | None]
    # Rows whose own parameters made sampling fail: row -> what went wrong. Their token is
    # -1; the engine fails those requests alone.
    errors: dict[int, str] = field(default_factory=dict)


class SampledTokens:
    """A step's sampled tokens while they are still on the device: the next step can read
    ``token_ids`` there without waiting (asynchronous scheduling, chapter 17), and their
    copy to the host, queued right behind the sampling, is read by ``to_host``, which waits
    for this step's work only."""

    def __init__(self, token_ids: torch.Tensor, logprobs: tuple | None, ks: list[int | None]):
        self.token_ids = token_ids  # [rows] on the device
        self.ks = ks  # per row: how many top log-probs it wants, or None
        self._done: SamplerOutput | None = None
        parts = (token_ids, *(logprobs or ()))
        if token_ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
            for host, dev in zip(self._host, parts):
                host.copy_(dev, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = list(parts), None

    @classmethod
    def on_host(cls, output: SamplerOutput, device: torch.device) -> "SampledTokens":
        """Tokens already on the host (the sampler's rescue path, which samples row by row)."""
        # A failed row's -1 becomes a valid id on the device: under asynchronous scheduling
        # the next step may already read it, before the host has failed that request.
        on_device = torch.tensor([max(t, 0) for t in output.token_ids], device=device)
        done = cls(on_device, None, [None] * len(output.token_ids))
        done._done = output
        return done

    def to_host(self) -> SamplerOutput:
        if self._done is None:
            if self._ready is not None:
                self._ready.synchronize()
            token_list = self._host[0].tolist()
            logprobs: list = [None] * len(token_list)
            if len(self._host) > 1:
                chosen, rank, top_ids, top_values = (t.tolist() for t in self._host[1:])
                for row, k in enumerate(self.ks):
                    if k is not None:
                        logprobs[row] = (chosen[row], rank[row], top_ids[row][:k], top_values[row][:k])
            self._done = SamplerOutput(token_list, logprobs)
        return self._done


def rows_to_device(values: list[list[float]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row settings decided on the host, in one copy that does not wait for the device
    (pinned memory, non-blocking): a blocking copy would wait for the forward pass queued
    before it, and the host could not run ahead of the GPU."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
