"""``speculative_config``: vLLM's dictionary, checked into a dataclass."""
from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: the most drafts a sequence proposes per step
    prompt_lookup_min: int = 1  # the shortest suffix the n-gram proposer looks up
    prompt_lookup_max: int = 3  # the longest (tried first)

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {sorted(unknown)}; accepted: {sorted(known)}")
        if "method" not in d:
            raise ValueError('speculative_config needs a "method" ("ngram")')
        if d["method"] not in METHODS:
            raise ValueError(f"speculative_config method={d['method']!r} is not implemented yet: ngram only")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs num_speculative_tokens (k >= 1)")
        config = cls(**d)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be an int >= 1")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={config.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={config.prompt_lookup_max}")
        return config
