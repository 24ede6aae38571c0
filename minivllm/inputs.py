"""vLLM's prompt types (``vllm.inputs``): the dicts ``LLM.generate`` takes besides a string or
a list of token ids. They are ``TypedDict``s, so a plain dict with the same keys is the same
prompt."""
from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer (no special tokens added)."""

    prompt: str
    # vLLM's multimodal fields (multi_modal_data, mm_processor_kwargs) are absent: minivllm
    # serves text models only, and refuses a prompt that carries them.


class TokensPrompt(TypedDict):
    """A prompt as token ids, run as they are; ``prompt`` (optional) is its text, reported back
    in ``RequestOutput.prompt``."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
