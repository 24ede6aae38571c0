"""Reasoning models (``--reasoning-parser``): the text a model writes between ``<think>`` and
``</think>`` is its reasoning, sent apart from the answer's content.

vLLM sends it as the message's (or the stream delta's) ``reasoning`` field, and under its
older name ``reasoning_content`` too (what DeepSeek's API named it, and what LangChain and
LiteLLM read): this server fills both with the same text.

Where the reasoning starts depends on the prompt as much as on the model, so the rendered
prompt sets the splitter's first state:

- the prompt ends with ``<think>`` (a template that opens the reasoning itself, as Qwen3's
  thinking-only and DeepSeek-R1's newer ones do): the output starts inside the reasoning;
- the prompt ends with ``</think>`` (Qwen3's template with ``enable_thinking: false`` writes
  an empty ``<think>\\n\\n</think>\\n\\n``): there is no reasoning, the whole output is content;
- otherwise the model decides: ``qwen3`` reads a reasoning only if the output opens with
  ``<think>``; ``deepseek_r1`` (whose model may leave out the opening tag) reads everything
  before ``</think>`` as reasoning, and an output that never closes it as all reasoning.

A request with structured output (a JSON schema, tools, a regex...) is constrained after the
reasoning only, as in vLLM: the model reasons in free text, and its grammar starts after the
end tag's token (``grammar_after_reasoning``; Qwen3's and DeepSeek-R1's vocabularies have the
tags as single tokens). So a model that answers without closing a reasoning is never
constrained, as in vLLM (a reasoning model given a prompt that leaves it to reason does
reason). A prompt whose last tag closed a reasoning (enable_thinking false) is constrained
from the first token; so is every request to a model whose vocabulary spells the tags in
several tokens (the grammar waits for one token; vLLM refuses such a parser at start-up).
The usage counts the reasoning's tokens (``reasoning_tokens``).

Streamed, the splitter is fed the growing text and answers what is new on each side; the
tags may arrive split across deltas (``</th`` then ``ink>``), so a tail of text that could
be the start of a tag is held back until the next delta says what it is. Each character
is looked at a bounded number of times: a long answer costs a stream no more than its length.
"""
import dataclasses
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    """A model family's reasoning tags, and whether its output may start inside the
    reasoning without the opening tag (``implicit_start``)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_start: bool = False

    def splitter(self, prompt_text: str) -> "ReasoningSplitter":
        return ReasoningSplitter(self, prompt_text)

    def split(self, prompt_text: str, text: str) -> tuple[str | None, str]:
        """A whole output's (reasoning or None, content)."""
        splitter = self.splitter(prompt_text)
        splitter.feed(text, finished=True)
        return splitter.reasoning_text(), splitter.content

    def grammar_start(self, tokenizer, prompt_ids: list[int]) -> int | None:
        """The token after which a grammar starts for this prompt: the end tag's, unless the
        prompt's last tag closed a reasoning (Qwen3's template with enable_thinking false; a
        final assistant message continued after its reasoning), as vLLM decides, or the tags
        are not one token each (None: the grammar starts at once)."""
        start, end = tag_token_id(tokenizer, self.start), tag_token_id(tokenizer, self.end)
        if start is None or end is None or last_index(prompt_ids, end) > last_index(prompt_ids, start):
            return None
        return end

    def reasoning_tokens(self, tokenizer, token_ids: list[int], reasoning: str | None) -> int:
        """How many of an output's tokens are its reasoning (``reasoning``: the splitter's text
        of it, None when it read none). With one-token tags, the tokens between them (the tags
        not counted, as vLLM counts): from after the first start tag, or from the output's
        start when the prompt opened the reasoning, to the first end tag or the output's end.
        Otherwise the reasoning's text encoded again (its count, very nearly)."""
        if reasoning is None:
            return 0
        start, end = tag_token_id(tokenizer, self.start), tag_token_id(tokenizer, self.end)
        if start is None or end is None:
            return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        stop = token_ids.index(end) if end in token_ids else len(token_ids)
        begin = token_ids.index(start, 0, stop) + 1 if start in token_ids[:stop] else 0
        return stop - begin


@functools.lru_cache(maxsize=16)
def tag_token_id(tokenizer, tag: str) -> int | None:
    """``tag``'s id in ``tokenizer`` if it is one token, else None (found once per tokenizer)."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def last_index(ids: list[int], token: int) -> int:
    """Where ``token`` last occurs in ``ids`` (-1: nowhere)."""
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1


def grammar_after_reasoning(params, parser: ReasoningParser | None, tokenizer, prompt_ids: list[int]) -> None:
    """Start the grammar of ``params`` (a request's SamplingParams), if it has one, after the
    reasoning (StructuredOutputsParams.reasoning_end_token_id): what vLLM does with a
    reasoning parser. (The spec is replaced, not changed: a tool's may be shared. The params
    are the request's own, and set in place: built again, a whole vocabulary's logprobs
    would fail SamplingParams' own check.)"""
    if parser is None or params.structured_outputs is None:
        return
    end = parser.grammar_start(tokenizer, prompt_ids)
    if end is not None:
        params.structured_outputs = dataclasses.replace(params.structured_outputs, reasoning_end_token_id=end)


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r}: known parsers are {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


# The splitter's states: before the output's first word (does it open a reasoning?), inside
# the reasoning, in the content (for good: a tag there is the answer's own text).
OPENING, REASONING, CONTENT = "opening", "reasoning", "content"


class ReasoningSplitter:
    """One completion's output, split as it grows into reasoning and content."""

    def __init__(self, parser: ReasoningParser, prompt_text: str):
        self.parser = parser
        tail = prompt_text.rstrip()
        self.state = CONTENT if tail.endswith(parser.end) else OPENING
        # Inside the reasoning from the start: the prompt opened it, or the model may leave the tag out.
        self.implicit = tail.endswith(parser.start) or parser.implicit_start
        self.reasoning = ""
        self.content = ""
        self.saw_reasoning = False
        self.done = 0  # characters of the output handled (what follows is new or held back)

    def reasoning_text(self) -> str | None:
        return self.reasoning if self.saw_reasoning else None

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        """The output so far (``text``, cumulative): the (reasoning, content) it adds."""
        before = len(self.reasoning), len(self.content)
        if self.state == OPENING:
            self._open(text, finished)
        if self.state == REASONING:
            self._reason(text, finished)
        if self.state == CONTENT:
            self.content += text[self.done:]
            self.done = len(text)
        return self.reasoning[before[0]:], self.content[before[1]:]

    def _open(self, text: str, finished: bool) -> None:
        """Decide, from the output's first non-blank characters, whether a reasoning opens."""
        start = self.parser.start
        head = text[self.done:].lstrip()
        if head.startswith(start):
            self.done = text.index(start, self.done) + len(start)
            self.state, self.saw_reasoning = REASONING, True
        elif start.startswith(head) and not finished:
            return  # blank, or the tag's beginning: wait for more
        elif self.implicit:
            self.state, self.saw_reasoning = REASONING, True
        else:
            self.state = CONTENT

    def _reason(self, text: str, finished: bool) -> None:
        end = self.parser.end
        found = text.find(end, self.done)
        if found >= 0:
            self.reasoning += text[self.done:found]
            self.done = found + len(end)
            self.state = CONTENT
            return
        safe = len(text) if finished else len(text) - held_back(text, self.done, end)
        self.reasoning += text[self.done:safe]
        self.done = safe


def held_back(text: str, start: int, tag: str) -> int:
    """How many of ``text``'s last characters (after ``start``) could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningAnswer:
    """The reasoning of one chat request's choices, apart from their content: split whole,
    or as each choice's stream grows (a splitter per choice)."""

    def __init__(self, parser: ReasoningParser, prompt_text: str):
        self.parser = parser
        self.prompt_text = prompt_text
        self.splitters: dict[int, ReasoningSplitter] = {}

    def split(self, index: int, text: str, finished: bool, stream: bool) -> tuple[str, str, str | None]:
        """(the content so far, the content new since the last call, the reasoning: new since
        the last call when streamed, else the whole reasoning or None) of choice ``index``."""
        if not stream:
            reasoning, content = self.parser.split(self.prompt_text, text)
            return content, content, reasoning
        splitter = self.splitters.setdefault(index, self.parser.splitter(self.prompt_text))
        reasoning, new = splitter.feed(text, finished)
        return splitter.content, new, reasoning

    @staticmethod
    def fields(message: dict, reasoning: str | None, stream: bool) -> dict:
        """``message`` (or a stream's delta) with the reasoning under both its names. A
        delta carries them only when there is new reasoning (and then no empty content); a
        message always, null when the model did not reason (and its content is null when it
        only reasoned)."""
        if stream:
            if not reasoning:
                return message
            if message.get("content") == "":  # (a delta of reasoning alone, as vLLM's)
                message = {k: v for k, v in message.items() if k != "content"}
            return {**message, "reasoning": reasoning, "reasoning_content": reasoning}
        if reasoning is not None and message.get("content") == "":
            message = {**message, "content": None}
        return {**message, "reasoning": reasoning, "reasoning_content": reasoning}
