"""Model configuration: what a checkpoint's config.json says, checked against its weights.

A config.json is not always the whole truth. Some checkpoints carry attention biases that
the config does not mention, or q/k norms under a family name that never had them. So we
read the tensor names in the safetensors headers (no weights loaded) and let them decide.

Vision-language checkpoints of a family we run as text (Qwen3.5's, all of them on the hub)
nest the text model's settings under ``text_config`` and its tensors under
``model.language_model.``: we flatten the config to the text model's (``text_part``) and
the loader renames the tensors (``text_tensor_name``).

Beside it, the engine's settings (``EngineConfig``) and speculative decoding's
(``SpeculativeConfig``): configuration lives here, below every module that reads it.
"""
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minivllm.safetensors_index import tensor_names

logger = logging.getLogger(__name__)


# Vision-language architectures whose text model we run alone -> that text model's class.
TEXT_MODEL_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
# Where such a checkpoint keeps the text model's tensors, and where our model keeps them.
LANGUAGE_MODEL_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
# Parts of such a checkpoint that the text model does not use, skipped on purpose: the
# vision tower (and its merger into the text model's width), and the multi-token-
# prediction head (extra layers that draft tokens for speculative decoding).
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


def text_part(hf: dict) -> tuple[dict, bool]:
    """A vision-language config.json flattened to its text model's (and True), or ``hf``
    unchanged (and False). The top level says how weights are stored (tied embeddings,
    dtype): that wins over the nested text_config's defaults."""
    architectures = hf.get("architectures") or []
    if not architectures or architectures[0] not in TEXT_MODEL_OF:
        return hf, False
    if not isinstance(hf.get("text_config"), dict):
        raise ValueError(f"{architectures[0]} config.json has no 'text_config' to load the text model from")
    flat = dict(hf["text_config"])
    flat["architectures"] = [TEXT_MODEL_OF[architectures[0]]]
    flat.update({key: hf[key] for key in ("tie_word_embeddings", "dtype", "torch_dtype") if key in hf})
    if flat.get("eos_token_id") is None and hf.get("eos_token_id") is not None:
        flat["eos_token_id"] = hf["eos_token_id"]
    return flat, True


def text_tensor_name(name: str) -> str | None:
    """A vision-language checkpoint's tensor name as the text model calls it, or None for
    a part skipped on purpose (SKIPPED_PREFIXES). Anything else keeps its name, so the
    loader still rejects what has no place in the model."""
    if name.startswith(LANGUAGE_MODEL_PREFIX):
        return TEXT_PREFIX + name[len(LANGUAGE_MODEL_PREFIX):]
    if name.startswith(SKIPPED_PREFIXES):
        return None
    return name


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on the q/k/v projections
    o_proj_bias: bool = False  # a bias on the output projection (Llama/Qwen3 with attention_bias; not Qwen2)
    qk_norm: bool = False
    # Gemma 3: local (sliding-window) layers among global ones, each kind with its own RoPE.
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # "sliding_attention" / "full_attention" per layer
    rope_local_theta: float | None = None  # RoPE base of the sliding layers
    query_pre_attn_scalar: float | None = None  # attention scale is its inverse square root
    final_logit_softcapping: float | None = None  # logits -> tanh(logits / cap) * cap
    # Mixture of experts (Qwen3-MoE): num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: experts each token is sent to
    moe_intermediate_size: int = 0  # each expert's feed-forward width
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to one
    decoder_sparse_step: int = 1  # every step-th layer is sparse ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these, which stay dense
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: a gated expert every token goes through
    vision_language: bool = False  # the text part of a vision-language checkpoint (see text_part)
    # A checkpoint published in fp8 (the hub's Qwen3 FP8): its config.json's quantization_config,
    # checked (fp8_quantization_config). None: the weights are in torch_dtype.
    quantization_config: dict | None = None
    torch_dtype: torch.dtype = torch.float32
    eos_token_id: list[int] = field(default_factory=list)
    hf_config: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                                 f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError("moe_intermediate_size and decoder_sparse_step must be positive, got "
                                 f"{self.moe_intermediate_size} and {self.decoder_sparse_step}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Does layer ``layer_idx`` route through experts (else: one dense MLP)?"""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``path/config.json`` and reconcile it with the tensors in ``path``."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"no config.json in {path}")
        config = cls.from_dict(json.loads(config_file.read_text()))
        names = tensor_names(path)
        if config.vision_language:
            names = {text_tensor_name(n) for n in names} - {None}
        config.detect_from_weights(names)
        return config

    @classmethod
    def from_dict(cls, hf: dict) -> "ModelConfig":
        hf, vision_language = text_part(hf)
        # transformers >= 5 nests RoPE settings under "rope_parameters"; older files use
        # "rope_theta" and "rope_scaling" at the top level.
        rope = dict(hf.get("rope_parameters") or {})
        # Gemma 3 keeps one RoPE dict per layer type: the global layers' is the model's.
        local_rope = rope.pop("sliding_attention", None)
        rope = dict(rope.pop("full_attention", None) or rope)
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype_name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        num_heads = hf["num_attention_heads"]
        architectures = hf.get("architectures") or []
        layer_types = hf.get("layer_types")
        if layer_types is None and hf.get("sliding_window_pattern") and hf.get("sliding_window"):
            pattern = hf["sliding_window_pattern"]
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(hf["num_hidden_layers"])]
        if layer_types and "sliding_attention" not in layer_types:
            layer_types = None  # all global (e.g. Qwen2 without its sliding window): nothing to record
        local_theta = (local_rope or {}).get("rope_theta", hf.get("rope_local_base_freq"))
        if not architectures:
            raise ValueError("config.json names no 'architectures'; cannot pick a model class")
        return cls(
            architecture=architectures[0],
            model_type=hf.get("model_type", ""),
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            # Qwen3.5-MoE has no dense feed-forward, so no intermediate_size: the experts' width stands in.
            intermediate_size=hf.get("intermediate_size") or hf.get("moe_intermediate_size") or hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            partial_rotary_factor=hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", hf.get("model_type") == "qwen2"),
            o_proj_bias=hf.get("attention_bias", False) and hf.get("model_type") != "qwen2",
            qk_norm=hf.get("model_type") in ("qwen3", "qwen3_moe"),
            torch_dtype=getattr(torch, dtype_name) if isinstance(dtype_name, str) else dtype_name,
            sliding_window=hf.get("sliding_window") if layer_types else None,
            layer_types=list(layer_types) if layer_types else None,
            rope_local_theta=None if local_theta is None else float(local_theta),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            # transformers writes the expert count as "num_local_experts" (its attribute map),
            # the hub's Qwen3-MoE configs as "num_experts".
            num_experts=hf.get("num_experts") or hf.get("num_local_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
            vision_language=vision_language,
            quantization_config=fp8_quantization_config(hf.get("quantization_config")),
            eos_token_id=eos,
            hf_config=hf,
        )

    def detect_from_weights(self, names: set[str]) -> None:
        """Let the checkpoint's tensors overrule config.json where they disagree."""
        if not names:
            return
        self.attention_bias = "model.layers.0.self_attn.q_proj.bias" in names
        self.o_proj_bias = "model.layers.0.self_attn.o_proj.bias" in names
        self.qk_norm = "model.layers.0.self_attn.q_norm.weight" in names
        # A checkpoint without a separate head must reuse the embedding matrix.
        if "lm_head.weight" not in names:
            self.tie_word_embeddings = True


def fp8_quantization_config(quantization_config: dict | None) -> dict | None:
    """A checkpoint's ``quantization_config``, checked: what this engine loads is the hub's
    fp8 layout, e4m3 weights with [rows, columns] block scales and activations quantized
    at each call (dynamic). Anything else is refused by name before any weight is read."""
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method={method!r} is not supported yet; implemented: 'fp8'")
    block = quantization_config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config weight_block_size={block!r}: an fp8 checkpoint without [rows, columns] "
                         "weight blocks (per-tensor scales) is not supported yet")
    scheme = quantization_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config activation_scheme={scheme!r} is not supported yet; implemented: "
                         "'dynamic' (activation scales computed at each call)")
    return {**quantization_config, "weight_block_size": list(block)}


# EngineConfig.quantization's values (vLLM's names). None, "none" and "auto" keep the weights
# as the checkpoint has them; "fp8" quantizes a bf16 or fp32 checkpoint's linear layers at load.
QUANTIZATIONS = (None, "none", "auto", "fp8")


def check_quantization(quantization) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported yet; implemented: "
                         f"{', '.join(map(repr, QUANTIZATIONS))}")


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``speculative_config`` (chapter 19): vLLM's dictionary, checked into a dataclass.

    Three methods: ``"ngram"`` (prompt lookup, ``minivllm.spec_decode.ngram``),
    ``"draft_model"`` (a small model of the same tokenizer, ``minivllm.spec_decode.draft``)
    and ``"mtp"`` (the multi-token-prediction head that Qwen3.5 and Qwen3-Next checkpoints
    carry, ``minivllm.spec_decode.mtp``: it is read from the target's own checkpoint, so it
    takes no ``"model"``). As in vLLM, a dictionary that names a ``"model"`` and no method
    means a draft model."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: the most drafts a sequence proposes per step
    prompt_lookup_min: int = 1  # the shortest suffix the n-gram proposer looks up
    prompt_lookup_max: int = 3  # the longest (tried first)
    model: str | None = None  # draft_model: the draft checkpoint's folder

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "model", *NGRAM_KEYS}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {sorted(unknown)}; accepted: {sorted(known)}")
        d = dict(d)
        if "method" not in d:
            if d.get("model") is None:
                raise ValueError('speculative_config needs a "method" ("ngram"), or a draft "model" (a folder)')
            d["method"] = "draft_model"  # as vLLM infers it from a model that is not an n-gram's
        if d["method"] not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={d['method']!r} is not implemented yet; "
                             f"implemented: {', '.join(SPECULATIVE_METHODS)}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs num_speculative_tokens (k >= 1)")
        if d["method"] == "ngram" and d.get("model") is not None:
            raise ValueError('speculative_config model is for method "draft_model"; method "ngram" takes none')
        if d["method"] == "mtp" and d.get("model") is not None:
            raise ValueError('speculative_config model is for method "draft_model"; method "mtp" takes none (it '
                             "reads the multi-token-prediction head from the target model's own checkpoint)")
        if d["method"] in ("draft_model", "mtp"):
            given = [key for key in NGRAM_KEYS if key in d]
            if given:
                raise ValueError(f'speculative_config {", ".join(given)}: for method "ngram" only, '
                                 f'not {d["method"]!r}')
        if d["method"] == "draft_model":
            check_draft_folder(d.get("model"))
            d["model"] = str(Path(d["model"]).expanduser())
        config = cls(**d)
        for name in ("num_speculative_tokens", *NGRAM_KEYS):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be an int >= 1")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={config.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={config.prompt_lookup_max}")
        return config

    def check_target(self, target: ModelConfig) -> None:
        """A draft model must speak the target's tokens (``target``: its ModelConfig): the
        verifier compares token ids, and the draft reads the ids the target emitted."""
        draft_vocab_size = ModelConfig.from_pretrained(self.model).vocab_size
        if draft_vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config model={self.model!r} has a vocabulary of {draft_vocab_size} "
                             f"tokens, the target model {target.vocab_size}: a draft model must share the target's "
                             "tokenizer (the same vocabulary size)")


def check_draft_folder(model) -> None:
    """The draft checkpoint must be a local folder with a config.json."""
    if model is None:
        raise ValueError('speculative_config method "draft_model" needs a "model": the draft checkpoint\'s folder')
    if not isinstance(model, (str, Path)):
        raise ValueError(f"speculative_config model must be a folder path (a string), got {type(model).__name__}")
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config model={str(model)!r} is not a checkpoint folder (no config.json "
                         "there): give the local folder of the draft model")


# kv_cache_dtype's float8 names (vLLM's): e4m3, whose 3 mantissa bits keep more precision
# than e5m2's 2, and whose range (+-448) a per-layer scale easily fits keys and values into.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class EngineConfig:
    """How the engine runs a model. Only these names are accepted as engine arguments."""

    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    max_num_seqs: int = 256
    # The step's token budget. None: 16,384 on a GPU (vLLM's LLM class and nano-vllm's
    # default; an eager prefill step then has twice the GPU work of 8,192 for the same host
    # work of launching it, so the host keeps ahead), 8,192 on the CPU.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the pool size (tests, the CPU)
    cpu_kv_cache_space: float = 0.5  # GiB of KV pool on the CPU when num_kv_blocks is not given
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    record_trace: bool = False  # keep a per-step trace (who ran, blocks in use, hits, preemptions)
    tensor_parallel_size: int = 1  # processes (GPUs) that split every layer's weights (chapter 16)
    # Prepare step N+1 while the device runs step N (chapter 17). None: on for one GPU, off on
    # the CPU (where nothing runs beside the host) and under tensor parallelism (the other
    # ranks would need the sampled tokens that only rank 0 holds).
    async_scheduling: bool | None = None
    # Where the default sampling settings come from (vLLM's --generation-config): "auto", the
    # checkpoint's generation_config.json; "vllm", none (SamplingParams' own); or a folder
    # holding a generation_config.json.
    generation_config: str = "auto"
    # Speculative decoding (chapter 19), vLLM's dictionary: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}, or
    # {"model": draft_folder, "num_speculative_tokens": k} (method "draft_model"). None: off.
    speculative_config: dict | None = None
    # Weights in fp8 (chapter 20): "fp8" quantizes the linear layers of a bf16 or fp32
    # checkpoint at load (``layers.quantization``); None, "none" or "auto" keep the
    # checkpoint's format. A checkpoint published in fp8 loads as published either way.
    quantization: str | None = None
    # The KV cache's element type (vLLM's names): "auto", the engine's dtype; "fp8" (or
    # "fp8_e4m3"), float8 e4m3 with one scale per layer for K and one for V (chapter 20):
    # half the bytes a key costs in bf16, so twice the blocks in the same memory.
    kv_cache_dtype: str = "auto"
    # An fp8 cache's scales measured instead of given (vLLM's calculate_kv_scales): each
    # attention layer sets its k_scale and v_scale once, to the largest |key| and |value|
    # of the first step that stores any, over 448 (``Attention.calculate_kv_scales_on_next_store``).
    # False: the checkpoint's scales, or 1.0.
    calculate_kv_scales: bool = False

    def __post_init__(self):
        check_quantization(self.quantization)
        self.speculative = None
        if self.speculative_config is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
            if self.speculative.method == "draft_model":  # before any weights are loaded
                self.speculative.check_target(ModelConfig.from_pretrained(self.model))
            # The proposer reads the tokens the last step accepted, so each step is processed
            # before the next is scheduled: the synchronous loop, for now.
            if self.async_scheduling:
                raise ValueError("speculative_config needs async_scheduling=False: the proposer needs the "
                                 "tokens the last step accepted on the host before it schedules the next")
            self.async_scheduling = False
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config needs tensor_parallel_size=1 (not supported yet with "
                                 "tensor parallelism)")
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda") and self.tensor_parallel_size == 1
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 16384 if self.device.startswith("cuda") else 8192
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling=True needs tensor_parallel_size=1: under tensor parallelism only "
                             "rank 0 holds the sampled tokens the next step's inputs are made of")
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size")
        # None, for these two: the engine decides.
        _positive(self, *(n for n in ("num_kv_blocks", "max_model_len") if getattr(self, n) is not None))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.cpu_kv_cache_space <= 0:
            raise ValueError(f"cpu_kv_cache_space={self.cpu_kv_cache_space} must be > 0 (GiB)")
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config={self.generation_config!r} must be 'auto', 'vllm' or a folder")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
                             f"{['auto', *FP8_KV_CACHE_DTYPES]}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            # Accepted, as vLLM accepts it, so that its command lines start unchanged: a cache
            # in the model's dtype stores keys as they are and never reads a scale.
            logger.warning("calculate_kv_scales=True changes nothing with kv_cache_dtype='auto': only an fp8 "
                           "cache (kv_cache_dtype='fp8') stores keys and values divided by a scale")

    @property
    def cache_dtype(self) -> torch.dtype:
        """The torch dtype of the KV cache's elements."""
        return self.dtype if self.kv_cache_dtype == "auto" else FP8_KV_CACHE_DTYPES[self.kv_cache_dtype]

    def check_max_model_len(self, model_config: ModelConfig) -> None:
        """A max_model_len past the model's positions is refused (as vLLM does): RoPE and the
        model were never trained there, so it would not be a longer context but garbage."""
        limit = model_config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} is more than this model's max_position_embeddings "
                             f"({limit}): leave it out, or give at most {limit}")


# The sampling settings a generation_config.json may give defaults for. vLLM also takes
# repetition_penalty from it; here a request's repetition_penalty is only its own.
GENERATION_DEFAULTS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float}


def generation_defaults(model: str | Path, generation_config: str = "auto") -> dict:
    """The defaults a checkpoint's authors chose for the sampling fields, from its
    generation_config.json (``generation_config`` as EngineConfig's): the settings a request
    leaves out take these, offline and served. A file that does not exist gives none."""
    if generation_config == "vllm":
        return {}
    folder = Path(model) if generation_config == "auto" else Path(generation_config)
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    hf = json.loads(file.read_text())
    # top_k 0 in transformers means "off", as it does in SamplingParams: kept as is.
    return {name: kind(hf[name]) for name, kind in GENERATION_DEFAULTS.items() if hf.get(name) is not None}


def _positive(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
