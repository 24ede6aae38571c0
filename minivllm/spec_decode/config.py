"""``speculative_config``: vLLM's dictionary, checked into a dataclass.

Three methods: ``"ngram"`` (prompt lookup, ``minivllm.spec_decode.ngram``),
``"draft_model"`` (a small model of the same tokenizer, ``minivllm.spec_decode.draft``) and
``"mtp"`` (the multi-token-prediction head that Qwen3.5 and Qwen3-Next checkpoints carry,
``minivllm.spec_decode.mtp``: it is read from the target's own checkpoint, so it takes no
``"model"``). As in vLLM, a dictionary that names a ``"model"`` and no method means a draft
model.
"""
from dataclasses import dataclass
from pathlib import Path

METHODS = ("ngram", "draft_model", "mtp")
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
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
        if d["method"] not in METHODS:
            raise ValueError(f"speculative_config method={d['method']!r} is not implemented yet; "
                             f"implemented: {', '.join(METHODS)}")
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

    def check_vocab(self, draft_vocab_size: int, target_vocab_size: int) -> None:
        """A draft model must speak the target's tokens (the sizes are read from the two
        checkpoints' config.json by the caller): the verifier compares token ids, and the
        draft reads the ids the target emitted."""
        if draft_vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config model={self.model!r} has a vocabulary of {draft_vocab_size} "
                             f"tokens, the target model {target_vocab_size}: a draft model must share the target's "
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
