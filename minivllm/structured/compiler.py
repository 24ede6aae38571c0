"""Grammars on xgrammar, the engine vLLM uses by default: each request's spec becomes a
``CompiledGrammar`` once, and every later request with the same spec reuses it.

Compiling does the expensive part ahead of time: for each state of the grammar's pushdown
automaton, which of the vocabulary's tokens can follow ("adaptive token mask cache"), so that
at every step a matcher needs only the few tokens whose fate depends on the stack. It needs
the vocabulary as bytes (``TokenizerInfo``: byte-level BPE tokens like ``Ġworld`` decoded to
`` world``), sized as the model's logits are.

A spec xgrammar cannot compile is the client's mistake and comes back as ``InvalidParameter``
naming it. So does a JSON schema keyword that xgrammar would silently ignore (``uniqueItems``,
``not``...): the output would then not follow the schema the client gave, and it is better to
say so than to return JSON that fails their validator.
"""
import json
import re
import threading
import time
from collections import OrderedDict

from minivllm.sampling_params import InvalidParameter
from minivllm.structured.params import StructuredOutputsParams

# Keywords xgrammar 0.2 accepts and does not enforce (checked by compiling schemas that use
# them and reading the grammar it makes): an output could break them.
UNSUPPORTED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "propertyNames", "not", "if",
                        "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                        "unevaluatedItems", "unevaluatedProperties")
# Keys whose value maps names to schemas (so the names are not keywords).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary, and caches what it compiled. Safe to
    call from several threads (xgrammar's compiler is; the cache is guarded)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids))
        # Our cache only, so that what a compile costs is visible (compile_seconds).
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self.cache: OrderedDict = OrderedDict()
        self.lock = threading.Lock()
        self.hits = self.misses = 0
        self.compile_seconds: list[float] = []  # one entry per compile (a cache miss)

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar of ``params`` (from the cache when it has been compiled)."""
        key = params.key
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                self.hits += 1
                return self.cache[key]
        start = time.perf_counter()
        compiled = self._compile(params)
        with self.lock:
            self.misses += 1
            self.compile_seconds.append(time.perf_counter() - start)
            self.cache[key] = compiled
            if len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        kind = params.kind
        any_whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                schema = parse_schema(params.json)
                check_schema(schema)
                return self.compiler.compile_json_schema(params.json, any_whitespace=any_whitespace)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except RuntimeError as e:  # xgrammar's parse errors
            raise InvalidParameter(f"SamplingParams.structured_outputs.{kind}: invalid {DESCRIPTION[kind]}: "
                                   f"{xgrammar_message(e)}", "structured_outputs") from None


DESCRIPTION = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
               "choice": "choice", "grammar": "EBNF grammar"}


def grammar_compiler_for(tokenizer, vocab_size: int, eos_token_ids) -> GrammarCompiler:
    """A compiler for a model's tokenizer; a model without one cannot take a grammar."""
    if tokenizer is None:
        raise InvalidParameter("SamplingParams.structured_outputs needs a tokenizer: the grammar speaks of "
                               "text, and this model ships none", "structured_outputs")
    return GrammarCompiler(tokenizer, vocab_size, sorted(eos_token_ids))


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose root is exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)  # JSON escapes are EBNF's


def parse_schema(text: str) -> dict | bool:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidParameter(f"SamplingParams.structured_outputs.json: the JSON schema is not valid JSON: {e}",
                               "structured_outputs") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidParameter("SamplingParams.structured_outputs.json: a JSON schema is an object (or a bool), "
                               f"got {type(schema).__name__}", "structured_outputs")
    return schema


def check_schema(schema, path: str = "#") -> None:
    """Refuse a schema that uses a keyword xgrammar would not enforce, naming it and where."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in UNSUPPORTED_KEYWORDS:
            unsupported(f"the keyword {key!r} (at {where})")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            unsupported(f"'allOf' with more than one schema (at {where})")
        if key == "$ref" and isinstance(value, str) and not (value == "#" or value.startswith("#/")):
            unsupported(f"a $ref outside the schema ({value!r} at {where})")
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}")
        elif isinstance(value, (dict, list)) and key not in ("enum", "const", "default", "examples", "required"):
            check_schema(value, where)


def unsupported(what: str) -> None:
    raise InvalidParameter(f"SamplingParams.structured_outputs.json: unsupported JSON schema feature: {what} "
                           "is not enforced by the grammar engine", "structured_outputs")


def xgrammar_message(error: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:08:38] /project/cpp/x.cc:83: ")."""
    text = str(error).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    return text.splitlines()[0] if text else type(error).__name__
