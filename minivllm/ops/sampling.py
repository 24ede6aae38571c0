"""Draw a token per row from the logits with temperature, or take the argmax: the op.

The Gumbel-max trick (``kernels.sampling``): argmax(x / T + Gumbel noise) is a draw from
softmax(x / T). The kernel makes its noise with Philox in registers; this reference draws
it with torch's generator from the same per-row seeds, so the two agree in distribution and
in their greedy rows, not draw for draw.
"""
import torch

from minivllm.ops.dispatch import use_triton


def gumbel_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                            seeds: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    tokens = []
    for row in range(x.shape[0]):
        if greedy[row]:
            tokens.append(x[row].argmax())
            continue
        gen = torch.Generator(device=x.device).manual_seed(int(seeds[row]) % 2**63)
        u = torch.rand(x.shape[1], generator=gen, device=x.device).clamp_min(torch.finfo(torch.float32).tiny)
        tokens.append((x[row] / temperature[row] - (-u.log()).log()).argmax())
    return torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long, device=x.device)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                  seeds: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab]; temperature, greedy: [rows] float32; seeds: [rows] int64.
    Returns [rows] int64 token ids."""
    if use_triton(logits):
        from minivllm.kernels import sampling

        return sampling.gumbel_argmax(logits, temperature, greedy, seeds)
    return gumbel_argmax_reference(logits, temperature, greedy, seeds)
