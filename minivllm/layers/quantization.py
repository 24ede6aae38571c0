"""How a linear layer stores its weight and computes y = x W^T: its quantization method.

A ``Linear`` holds a method and asks it for everything that depends on the weight's format:
which parameters the layer has (``create_weights``), what happens once the checkpoint is in
them (``process_weights_after_loading``) and the product itself (``apply``, and
``apply_gated`` for the feed-forward's gate/up projection ending in its activation). Models
never ask which format a layer has; the loader gives each layer its method before loading
(``set_linear_methods``) and lets it finish after.

Three methods:

- ``UnquantizedLinearMethod``: the weight in the model's dtype (every layer by default);
- ``Fp8LinearMethod`` (``quantization="fp8"`` on a bf16 or fp32 checkpoint): the weight is
  loaded as published, then quantized to e4m3 with one scale per output row; activations are
  quantized per token at each call (W8A8, ``ops.quant.fp8_linear``). For a few rows on a GPU
  the decode gemv reads the e4m3 weight and keeps the activations as they are (W8A16,
  ``ops.linear``): half the bytes of bf16, and no activation to quantize;
- ``Fp8BlockLinearMethod`` (a checkpoint whose config.json has an fp8 ``quantization_config``,
  as the hub's Qwen3 FP8 checkpoints): e4m3 weights with one ``weight_scale_inv`` per block
  (128 x 128 on the hub), loaded as they are, multiplied by ``ops.quant.fp8_block_linear``.

Only the decoder's projections are quantized (attention's qkv and o, the feed-forward's
gate_up and down). The embedding, the LM head and the norms stay in the model's dtype, and so
do the MoE experts (their fused kernel reads bf16; a checkpoint with fp8 experts is refused by
the loader, not yet supported), the routers (``NOT_QUANTIZED``: a router's few columns decide
which experts run, and are cheap) and, under ``quantization="fp8"``, every projection of a
Gated DeltaNet layer (``NOT_QUANTIZED_MODULES``): its input projection packs the gates that
set the recurrence's decay, and an error there is carried through every later token's state.
On random-weight hybrids it alone gave 75-90% of fp8 weights' error
(``benchmarks/quantization_error_sources.json``); the vLLM project's FP8 recipe for Qwen3.5
leaves these layers out too.
"""
import torch
from torch import nn

from minivllm.config import check_quantization
from minivllm.ops.activation import act_and_mul
from minivllm.ops.linear import gated_linear, gated_linear_fuses, linear
from minivllm.ops.quant import FP8_DTYPE, fp8_block_linear, quantize_per_row

# Linear layers that keep the model's dtype when a checkpoint is quantized at load: the routers of
# MoE layers, by their own name, and every linear layer inside a module of these names.
NOT_QUANTIZED = ("gate", "shared_expert_gate")
NOT_QUANTIZED_MODULES = ("linear_attn",)


class UnquantizedLinearMethod:
    """The weight [N, K] in the model's dtype, as ``Linear`` creates it: y = x W^T (+ b)."""

    def create_weights(self, layer: nn.Module) -> None:
        """The layer's parameters for this format, in place of the ones it was built with:
        here those, unchanged."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to do: the weight is used as loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def gated_fuses(self, layer: nn.Module, x: torch.Tensor, activation: str) -> bool:
        return gated_linear_fuses(x, layer.bias, activation)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
        return gated_linear(x, layer.weight, layer.bias, activation)


class Fp8LinearMethod(UnquantizedLinearMethod):
    """W8A8 per channel, quantized at load: the checkpoint's weight is loaded in the model's
    dtype, then becomes e4m3 [N, K] with ``weight_scale`` float32 [N, 1] (amax / 448 of each
    output row); activations are quantized per token at each call."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = quantize_per_row(layer.weight.data)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, layer.weight, bias, weight_scale=layer.weight_scale)

    def apply_gated(self, layer: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
        return gated_linear(x, layer.weight, layer.bias, activation, weight_scale=layer.weight_scale)


class Fp8BlockLinearMethod(UnquantizedLinearMethod):
    """A block-scaled fp8 checkpoint's layer, loaded as published: ``weight`` e4m3 [N, K] and
    ``weight_scale_inv`` float32 [ceil(N / bn), ceil(K / bk)] (the hub's name: the factor that
    takes e4m3 back to real values). Activations are quantized per token per bk columns."""

    def __init__(self, block: tuple[int, int]):
        self.block = tuple(block)

    def create_weights(self, layer: nn.Module) -> None:
        bn, bk = self.block
        for shard in getattr(layer, "shards", {}).values():
            _check_shard_blocks(shard, bn)
        if getattr(layer, "tp_size", 1) > 1 and layer.input_size % bk:
            raise ValueError(f"a block-scaled fp8 layer split over ranks needs {layer.input_size} input columns per "
                             f"rank to be a multiple of the block's {bk}")
        device = layer.weight.device
        del layer.weight
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, dtype=FP8_DTYPE, device=device),
                                    requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        scale = torch.empty(-(-layer.output_size // bn), -(-layer.input_size // bk), dtype=torch.float32, device=device)
        layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        layer.weight_scale_inv.weight_loader = lambda param, loaded, shard_id=None: self.load_scale(
            layer, param, loaded, shard_id)
        if hasattr(layer, "shards"):
            layer.weight.shard_ids = layer.weight_scale_inv.shard_ids = list(layer.shards)

    def load_scale(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """The checkpoint's block scales of this layer (or of one of its packed shards, or of
        this rank's columns), at the blocks of the rows and columns the layer keeps."""
        bn, bk = self.block
        if hasattr(layer, "shards"):
            if shard_id not in layer.shards:
                raise ValueError(f"unknown shard {shard_id!r}; this layer packs {list(layer.shards)}")
            shard = layer.shards[shard_id]
            expected, rows = (-(-shard.full_rows // bn), param.shape[1]), -(-shard.size // bn)
            source, target = loaded.narrow(0, shard.start // bn, rows), param.data.narrow(0, shard.offset // bn, rows)
        elif getattr(layer, "tp_size", 1) > 1:
            expected = (param.shape[0], -(-layer.full_input_size // bk))
            source, target = loaded.narrow(1, layer.tp_rank * param.shape[1], param.shape[1]), param.data
        else:
            expected, source, target = tuple(param.shape), loaded, param.data
        if tuple(loaded.shape) != expected:
            raise ValueError(f"weight_scale_inv: expected shape {expected} (blocks of {bn} x {bk}), "
                             f"got {tuple(loaded.shape)}")
        target.copy_(source)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_block_linear(x, layer.weight, layer.weight_scale_inv, self.block, bias)

    def gated_fuses(self, layer: nn.Module, x: torch.Tensor, activation: str) -> bool:
        return False

    def apply_gated(self, layer: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
        return act_and_mul(self.apply(layer, x, layer.bias), activation)


def _check_shard_blocks(shard, bn: int) -> None:
    """A packed shard must start on a block boundary, in the checkpoint and in the layer, and
    fill whole blocks, or end where its checkpoint tensor ends: each block has one scale."""
    last_block_is_partial = shard.start + shard.size == shard.full_rows
    if shard.start % bn or shard.offset % bn or (shard.size % bn and not last_block_is_partial):
        raise ValueError(f"a block-scaled fp8 layer packs {shard.size} rows at row {shard.offset}: "
                         f"each packed projection must be whole blocks of {bn} rows")


def linear_method(quantization: str | None, quantization_config: dict | None) -> UnquantizedLinearMethod | None:
    """The method of the model's quantized layers, or None to keep every weight as it is.
    A checkpoint published in fp8 (``quantization_config``) loads as published, whatever
    ``quantization`` says; "fp8" quantizes a checkpoint in a higher precision at load."""
    check_quantization(quantization)
    if quantization_config is not None:
        return Fp8BlockLinearMethod(quantization_config["weight_block_size"])
    return Fp8LinearMethod() if quantization == "fp8" else None


def quantizable(name: str) -> bool:
    """May a quantization method take the linear layer called ``name`` (its full name in the
    model, e.g. ``model.layers.0.linear_attn.in_proj``)?"""
    *modules, leaf = name.split(".")
    return leaf not in NOT_QUANTIZED and not any(m in NOT_QUANTIZED_MODULES for m in modules)


def set_linear_methods(layers: list[nn.Module], method: UnquantizedLinearMethod) -> None:
    """Give each of ``layers`` ``method``, with the parameters it creates in place of the
    ones the layer was built with."""
    for layer in layers:
        layer.quant_method = method
        method.create_weights(layer)


def finish_loading(model: nn.Module) -> None:
    """Let every linear layer's method process the weights just loaded (quantize them)."""
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)
