"""What a request asks its output to follow: ``StructuredOutputsParams``, vLLM's name and
fields. Exactly one of ``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (EBNF,
xgrammar's dialect, with a ``root`` rule) and ``json_object`` (any JSON object).

``reasoning_end_token_id`` says when the constraint starts: a reasoning model thinks first, in
free text, and only what follows its end-of-reasoning token (Qwen3's ``</think>``) must follow
the grammar. It belongs here rather than on SamplingParams because it means nothing without a
grammar; the server sets it (``--reasoning-parser``, ``server.reasoning``) for prompts that
leave the model to reason, as vLLM starts a grammar after the reasoning parser's end token.

Checked here for its shape (types, one constraint, sizes); whether the schema, regex or
grammar itself is valid is the compiler's question, asked when the engine takes the request.
"""
import json as _json
from dataclasses import dataclass

from minivllm.errors import InvalidParameter

# What one spec may weigh: compiling is done for the request before any other work, and a
# grammar's size drives its compile time and memory.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (text or a dict)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF: root ::= ...
    json_object: bool | None = None  # any JSON object
    # No free whitespace between JSON tokens (", " and ": " only), unlike vLLM's default:
    # a small model inside a grammar that allows whitespace anywhere may emit it forever.
    disable_any_whitespace: bool = True
    # The grammar starts after the output's first sampling of this token (a reasoning model's
    # </think>): the tokens before it, and it, are free. None: the grammar holds from the first token.
    reasoning_end_token_id: int | None = None

    def __post_init__(self):
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            _fail(f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})", "structured_outputs")
        if self.json is not None:
            if isinstance(self.json, dict):
                self.json = _json.dumps(self.json)
            _require(isinstance(self.json, str), "json", "a JSON schema (a dict or its JSON text)")
            _require(len(self.json) <= MAX_SPEC_CHARS, "json", f"at most {MAX_SPEC_CHARS} characters")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _require(isinstance(value, str) and value, name, "a non-empty string")
                _require(len(value) <= MAX_SPEC_CHARS, name, f"at most {MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            _require(isinstance(self.choice, (list, tuple)) and 0 < len(self.choice) <= MAX_CHOICES
                     and all(isinstance(c, str) and c for c in self.choice), "choice",
                     f"a list of 1 to {MAX_CHOICES} non-empty strings")
            _require(sum(map(len, self.choice)) <= MAX_SPEC_CHARS, "choice", f"at most {MAX_SPEC_CHARS} characters in all")
            self.choice = list(self.choice)
        _require(self.json_object in (None, True, False), "json_object", "a bool")
        _require(isinstance(self.disable_any_whitespace, bool), "disable_any_whitespace", "a bool")
        end = self.reasoning_end_token_id
        _require(end is None or (isinstance(end, int) and not isinstance(end, bool) and end >= 0),
                 "reasoning_end_token_id", "a token id (an int >= 0) or None")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on: equal keys share one compiled grammar."""
        spec = getattr(self, self.kind)
        return (self.kind, tuple(spec) if isinstance(spec, list) else spec, self.disable_any_whitespace)


KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _require(ok: bool, field: str, allowed: str) -> None:
    if not ok:
        _fail(f"{field} must be {allowed}", "structured_outputs")


def _fail(message: str, param: str) -> None:
    raise InvalidParameter(f"SamplingParams.structured_outputs: {message}", param)
