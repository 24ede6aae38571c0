"""The checkpoint's tokenizer, and incremental detokenisation for streaming."""
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from the checkpoint folder, or None if it ships none."""
    path = Path(path)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks characters that span several byte-level tokens, so we
    decode a short window and emit only the text that is complete (no trailing U+FFFD).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, token_ids: list[int]) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(token_ids[self.prefix_offset : self.read_offset])
        new_text = decode(token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
            return delta
        return ""
