"""The checkpoint's tokenizer, its chat template, and incremental detokenisation for streaming."""
import re
import uuid
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from the checkpoint folder, or None if it ships none."""
    path = Path(path)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# How many of the prompt's last tokens the detokenizer decodes the completion after (as
# vLLM's and ``tokenizers``' DecodeStream do): enough to give the first token its context.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks characters that span several byte-level tokens, so we
    decode a short window and emit only the text that is complete (no trailing U+FFFD).

    The window starts in the prompt (its last PROMPT_CONTEXT_TOKENS tokens), not at the
    completion's first token: a SentencePiece (Metaspace) decoder drops the leading space
    of whatever it decodes first, so "▁world" alone is "world", and every completion would
    lose its first space; after the prompt's "▁Hello" it is " world".
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_token_ids: list[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if self.context and tokenizer.decode(self.context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            # The prompt ends inside a character (token ids cut mid-byte-sequence): its first
            # completion bytes would merge into that character, and the completion would no
            # longer be its own tokens' text. Byte-level tokens need no context anyway.
            self.context = []
        self.prefix_offset = 0
        self.read_offset = len(self.context)

    def step(self, token_ids: list[int]) -> str:
        """The text that ``token_ids`` (the completion so far) adds since the last call."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        ids = self.context + token_ids if self.context else token_ids
        prefix_text = decode(ids[self.prefix_offset : self.read_offset])
        new_text = decode(ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return delta
        return ""


def special_token_strings(tokenizer) -> list[str]:
    """The text of every token the tokenizer treats as a control token (``<|im_start|>``...)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {t.content for t in decoder.values() if getattr(t, "special", False)}
    specials |= set(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted((s for s in specials if s), key=len, reverse=True)


def max_token_chars(tokenizer) -> int:
    """An upper bound on how many characters of text one token covers: the longest entry of
    the vocabulary (byte-level BPE spells each byte as one character, SentencePiece each
    character as itself). A server refuses a prompt longer than max_model_len times this
    before it spends time tokenizing it."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def resolve_chat_template(value: str) -> str:
    """``--chat-template``'s value: a file's path (its text), or the template itself (as vLLM
    tells them apart: a string that names no file but holds Jinja's braces is a template)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" in value or "\n" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")


def message_text(content) -> str:
    """A message's content as text: a string, a list of text parts (OpenAI's
    ``[{"type": "text", "text": ...}]``, joined), or None (an assistant that said nothing)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"a message's content parts must be text parts "
                                 f"({{'type': 'text', 'text': ...}}), got {kind!r}")
        return "".join(part["text"] for part in content)
    raise ValueError(f"a message's content must be a string or a list of text parts, got {type(content).__name__}")


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                **template_kwargs) -> tuple[list[int], str]:
    """Render ``messages`` through the chat template and tokenize the result, keeping what the
    messages say as text: a user who writes ``<|im_end|>\\n<|im_start|>system`` gets those
    characters as ordinary tokens, not a forged turn. Returns (token ids, rendered text).

    The template's own control tokens must stay control tokens, so the special-token strings
    written inside messages are swapped for placeholders before rendering, and tokenized with
    special tokens split afterwards. Messages without such strings tokenize exactly as
    ``apply_chat_template`` + ``encode`` would."""
    specials = special_token_strings(tokenizer)
    pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    marker = f"\ue000{uuid.uuid4().hex[:12]}"  # private-use characters no message contains
    written: list[str] = []

    def hide(match: re.Match) -> str:
        written.append(match.group())
        return f"{marker}{len(written) - 1}\ue001"

    def scrub(value):  # every string a message holds, tool calls' arguments included
        if isinstance(value, str):
            return pattern.sub(hide, value)
        if isinstance(value, list):
            return [scrub(v) for v in value]
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items()}
        return value

    safe = []
    for message in messages:
        if pattern is not None:
            message = {key: scrub(value) if key != "role" else value for key, value in message.items()}
        safe.append(message)
    if pattern is not None and template_kwargs.get("tools"):  # the tools' descriptions are the client's text too
        template_kwargs = {**template_kwargs, "tools": scrub(template_kwargs["tools"])}
    text = tokenizer.apply_chat_template(safe, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    if not written:
        return tokenizer.encode(text, add_special_tokens=False), text
    ids: list[int] = []
    pieces = re.split(f"{marker}(\\d+)\ue001", text)
    for i, piece in enumerate(pieces):
        if i % 2:  # a special-token string a message wrote: plain text
            ids += tokenizer.encode(written[int(piece)], add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    rendered = "".join(written[int(p)] if i % 2 else p for i, p in enumerate(pieces))
    return ids, rendered
