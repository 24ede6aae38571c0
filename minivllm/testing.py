"""Tiny random-weight Hugging Face checkpoints, for tests and CPU notebooks.

The checkpoint is written by transformers itself (its config class and model), so what we
load is exactly what a real checkpoint of that family looks like, only small. With
``with_tokenizer=True`` the folder also gets a small byte-level BPE tokenizer (its
vocabulary is exactly the model's 512 tokens), an end-of-text token and a ChatML chat
template, so text features (stop strings, streaming, chat) can be tested on tiny models.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from minivllm.distributed.processes import free_port

TINY_SHAPES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512)

FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    # Gemma 3 text: a small window and four layers, so local and global layers both appear.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    # Qwen3-MoE: eight small experts, two per token, in every layer.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    # Qwen3.5 text: Gated DeltaNet layers with one full-attention layer in four.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    # Qwen3.5-MoE text: the same hybrid layers, each with eight experts (two per token) and a shared one.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    # Qwen3-Next: Qwen3.5-MoE's layers with grouped in-projections; layer 0's feed-forward dense.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}

# Shapes a family needs beyond TINY_SHAPES (the caller's overrides still win).
FAMILY_SHAPES = {
    "gemma3": dict(num_hidden_layers=4, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   query_pre_attn_scalar=16),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen3_5": dict(num_hidden_layers=4,
                    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4),
}
FAMILY_SHAPES["qwen3_5_moe"] = dict(
    FAMILY_SHAPES["qwen3_5"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
FAMILY_SHAPES["qwen3_next"] = dict(FAMILY_SHAPES["qwen3_5_moe"], decoder_sparse_step=1, mlp_only_layers=[0],
                                   norm_topk_prob=True)
# Fields of TINY_SHAPES a family's config does not have (Qwen3.5-MoE has no dense MLP).
NOT_IN_CONFIG = {"qwen3_5_moe": ("intermediate_size",)}

# Vision-language checkpoints (as the hub publishes Qwen3.5): the config and model classes,
# and a vision tower as small as transformers builds it (its output is the text width).
VISION_LANGUAGE = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
}
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, num_position_embeddings=16)

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2

# ChatML, as Qwen uses it: every turn is "<|im_start|>role\ncontent<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Enough distinct text for the BPE trainer to find the 253 merges a 512-token vocabulary needs.
TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Hello, world! How are you today?",
    "The scheduler decides which sequences run in each step.",
    "Prefix caching lets requests that share a prompt share its blocks.",
    "Sampling draws the next token from the model's probabilities.",
    "It was the best of times, it was the worst of times.",
    "To be, or not to be, that is the question.",
    "Once upon a time there was a small language model that wanted to be fast.",
    "Numbers like 12, 345 and 6789 appear in text as well as words.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Continuous batching keeps the accelerator busy while requests come and go.",
)


# Families whose checkpoints carry a multi-token-prediction head (``mtp.*``) on the hub.
MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def make_tiny_checkpoint(
    path: str | Path, family: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = True, max_shard_size: str | int | None = None, init_std: float = 0.08,
    with_tokenizer: bool = False, vision_language: bool = False, mtp: bool = False, **overrides,
) -> Path:
    """Write a random-weight checkpoint of ``family`` to ``path`` and return the path.

    ``overrides`` change config fields (e.g. ``num_hidden_layers=4``). ``init_std`` is larger
    than transformers' default so the logits of a random model are not all nearly equal,
    which would make greedy decoding a coin toss between near-ties. ``with_tokenizer`` also
    writes a tokenizer whose end-of-text token (id 0) is the model's ``eos_token_id``.
    ``vision_language`` writes the family's vision-language model instead (the text model
    under ``model.language_model.``, a tiny vision tower beside it, the text settings nested
    in ``text_config``), as the hub publishes Qwen3.5. ``mtp`` (the Qwen3.5 and Qwen3-Next
    families) adds a random multi-token-prediction head, as ``add_mtp_head`` writes it; the
    rest of the checkpoint is the same as without.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; available: {sorted(FAMILIES)}")
    if mtp and family not in MTP_FAMILIES:
        raise ValueError(f"mtp=True: {family!r} checkpoints have no MTP head; families with one: {list(MTP_FAMILIES)}")
    config_name, model_name = FAMILIES[family]
    fields = {**TINY_SHAPES, "tie_word_embeddings": tie_word_embeddings, "initializer_range": init_std}
    if with_tokenizer:
        fields["eos_token_id"] = SPECIAL_TOKENS.index(EOS_TOKEN)
    fields.update(FAMILY_SHAPES.get(family, {}))
    for name in NOT_IN_CONFIG.get(family, ()):
        del fields[name]
    if mtp:
        fields["mtp_num_hidden_layers"] = 1  # as Qwen3.5's published configs say it
    fields.update(overrides)
    config = getattr(transformers, config_name)(**fields)
    if vision_language:
        if family not in VISION_LANGUAGE:
            raise ValueError(f"vision_language=True: no vision-language model for {family!r}; "
                             f"available: {sorted(VISION_LANGUAGE)}")
        config_name, model_name = VISION_LANGUAGE[family]
        vision = {**TINY_VISION, "out_hidden_size": config.hidden_size}
        config = getattr(transformers, config_name)(text_config=config.to_dict(), vision_config=vision,
                                                    tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    # Norm weights start at exactly one; perturb them so a wrong norm cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    # A tiny checkpoint is written in an instant: no progress bar in a notebook's output.
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(path, **kwargs)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    if with_tokenizer:
        write_tiny_tokenizer(path, vocab_size=config.vocab_size, model_max_length=config.max_position_embeddings)
    if mtp:
        add_mtp_head(path, seed=seed + 1, init_std=init_std)
    return path


def add_mtp_head(path: str | Path, seed: int = 0, init_std: float = 0.08) -> Path:
    """Add a random multi-token-prediction head to the Qwen3.5 / Qwen3-Next checkpoint at
    ``path``, as published checkpoints carry it: ``mtp.fc.weight`` [H, 2H], the RMSNorms
    ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` and ``mtp.norm`` (weights
    centred on zero, as the decoder's), and one full-attention decoder layer
    ``mtp.layers.0.*`` with the tensors (names, shapes, dtypes) of the checkpoint's first
    full-attention layer, drawn afresh. Sharded checkpoints get a shard of their own."""
    from safetensors.torch import load_file, save_file

    from minivllm.safetensors_index import safetensors_files

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    layers = "model.language_model.layers." if "text_config" in config else "model.layers."
    source = f"{layers}{text['layer_types'].index('full_attention')}."
    generator = torch.Generator().manual_seed(seed)

    def draw(shape, std, dtype):
        return (torch.randn(shape, generator=generator) * std).to(dtype)

    files = safetensors_files(path)
    tensors = {name: t for file in files for name, t in load_file(file).items()}
    dtype = tensors[f"{source}input_layernorm.weight"].dtype
    hidden = text["hidden_size"]
    head = {"mtp.fc.weight": draw((hidden, 2 * hidden), init_std, dtype)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{norm}.weight"] = draw((hidden,), 0.1, dtype)
    for name, t in sorted(tensors.items()):
        if name.startswith(source):
            std = 0.1 if "norm" in name else init_std
            head["mtp.layers.0." + name[len(source):]] = draw(t.shape, std, t.dtype)
    index = path / "model.safetensors.index.json"
    if index.exists():
        save_file(head, path / "model-mtp.safetensors", metadata={"format": "pt"})
        meta = json.loads(index.read_text())
        meta["weight_map"].update(dict.fromkeys(head, "model-mtp.safetensors"))
        index.write_text(json.dumps(meta, indent=2) + "\n")
    else:
        [file] = files
        save_file({**tensors, **head}, file, metadata={"format": "pt"})
    return path


def make_layer_skip_draft(target: str | Path, path: str | Path, num_layers: int, noise: float = 0.0,
                          seed: int = 0) -> Path:
    """Write a draft model for ``target`` (a Qwen3/Llama-style checkpoint): its first
    ``num_layers`` layers, with its embeddings, final norm and head, and Gaussian noise of
    ``noise`` times each tensor's standard deviation added. Return the path.

    Such a model shares the target's tokenizer and agrees with it often but not always
    (more layers and less noise: more often), so speculative decoding on it both accepts
    and rejects drafts: what tests of a draft proposer need when no trained draft is at
    hand. (Early-exit drafts of this kind are known as self-speculative or layer-skip.)"""
    from safetensors.torch import load_file, save_file

    from minivllm.safetensors_index import safetensors_files

    target, path = Path(target), Path(path)
    config = json.loads((target / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers={num_layers} must be in [1, {config['num_hidden_layers']}]")
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for file in safetensors_files(target):
        for name, t in load_file(file).items():
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
                continue
            if noise:
                t = (t.float() + torch.randn(t.shape, generator=generator) * noise * t.float().std()).to(t.dtype)
            tensors[name] = t.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


# The decoder projections a hub FP8 checkpoint stores in e4m3 (dense layers; experts stay as they are).
FP8_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def make_fp8_checkpoint(source: str | Path, path: str | Path, weight_block_size: tuple[int, int] = (16, 16)) -> Path:
    """Write ``source`` (a bf16 or fp32 checkpoint of a dense family) to ``path`` as the hub
    publishes its FP8 checkpoints: each decoder projection's ``weight`` in e4m3 with one
    float32 ``weight_scale_inv`` per block, everything else as it was, and config.json's
    ``quantization_config`` saying so. The hub's blocks are 128 x 128; a tiny model's
    matrices are 32 to 128 rows, so 16 x 16 blocks give each of them several. The
    tokenizer files, if any, are copied."""
    from safetensors.torch import load_file, save_file

    from minivllm.ops.quant import quantize_blocks
    from minivllm.safetensors_index import safetensors_files

    source, path = Path(source), Path(path)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(weight_block_size)}
    tensors = {}
    for file in safetensors_files(source):
        for name, t in load_file(file).items():
            if FP8_PROJECTION.match(name):
                tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t, weight_block_size)
            else:
                tensors[name] = t.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(file, path / file.name)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def dequantize_fp8_checkpoint(source: str | Path, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The reverse of ``make_fp8_checkpoint``: each e4m3 weight times its block scales, in
    ``dtype``, and no quantization_config. The same real numbers as the fp8 checkpoint
    holds, multiplied without quantizing the activations: the reference fp8 is checked on."""
    from safetensors.torch import load_file, save_file

    from minivllm.ops.quant import dequantize_blocks
    from minivllm.safetensors_index import safetensors_files

    source, path = Path(source), Path(path)
    config = json.loads((source / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    tensors = {name: t for file in safetensors_files(source) for name, t in load_file(file).items()}
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        tensors[weight] = dequantize_blocks(tensors[weight], tensors.pop(name), block).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({n: t.contiguous() for n, t in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def write_tiny_tokenizer(path: str | Path, vocab_size: int = 512, model_max_length: int = 512) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens on TOKENIZER_TEXT and save it in ``path``.

    Byte-level means any string encodes (unknown bytes fall back to the 256 byte tokens)
    and every id decodes, so random tokens from a random model still become text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the tiny tokenizer came out with {tok.get_vocab_size()} tokens, not {vocab_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


@contextmanager
def torch_threads(n: int = 1):
    """Run torch on ``n`` CPU threads inside the block.

    A tiny model's matmuls are microseconds long; on a busy machine, waking a pool of
    threads for each one costs far more than the work (often ten times the single-thread
    time), so engine tests on tiny checkpoints run single-threaded.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ServeProcess:
    """``minivllm serve`` in a process of its own on a free loopback port, for tests and
    measurements that need the real thing (its exit status, its memory)::

        with ServeProcess(["--api-key", "k"]) as server:
            httpx.get(server.url + "/health")

    ``prelude`` is Python run in that process before the command line (a test uses it to
    plant a fault in the engine); ``cwd``, a checkout whose ``minivllm`` the process runs."""

    def __init__(self, args: list[str] = (), prelude: str = "", env: dict | None = None, cwd: str | None = None,
                 startup_s: float = 180):
        self.port = free_port()  # released again before the server binds it: a tiny race, fine for tests
        self.argv = ["serve", "--port", str(self.port), *args]
        self.prelude, self.env, self.cwd, self.startup_s = prelude, env, cwd, startup_s
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServeProcess":
        import httpx

        self.log_file = tempfile.TemporaryFile(mode="w+")
        code = f"{self.prelude}\nfrom minivllm.cli import main\nmain({self.argv!r})\n"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(self.env or {})}, cwd=self.cwd)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minivllm serve exited with {self.proc.returncode} before it was up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"minivllm serve was not up after {self.startup_s} s:\n{self.log()}")

    def log(self) -> str:
        self.log_file.seek(0)
        return self.log_file.read()

    def engine_core_pid(self, timeout: float = 10.0) -> int | None:
        """The engine core's process (``--engine-process``), found among this process's
        children by its command line (the other child is multiprocessing's resource
        tracker); None if there is none after ``timeout`` seconds."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            pid = self.proc.pid
            for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return int(child)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def memory_mb(self, field: str = "VmHWM") -> float:
        """The process's resident memory from /proc (VmHWM: its peak so far; VmRSS: now), in MB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise KeyError(field)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, every thread) a process has used so far, from /proc."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
