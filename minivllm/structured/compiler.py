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

What a stranger's spec may cost is bounded: its size (``params.MAX_SPEC_CHARS``), a JSON
schema's nesting (``MAX_SCHEMA_DEPTH``: compile time grows with the cube of the depth, 46 s
for 900 levels in 22 kB), its compile time (``COMPILE_TIMEOUT_S``), the compiles running at
once (``COMPILE_THREADS``, each a thread that xgrammar's C++ runs on without the interpreter
lock), and what the cache keeps: the least recently used grammars are dropped past
``cache_size`` grammars or ``cache_bytes``.

Size does not bound time: an EBNF grammar of 1.8 kB (``[^"]*`` 300 times) takes over a
minute with a 151k vocabulary, and xgrammar's compile cannot be interrupted. So a spec is
first compiled on trial in a worker process (``compile_worker``), which is killed past
``compile_timeout_s``: the request fails with InvalidParameter naming the limit, and the
other compiles go on. A spec that compiled in time is compiled again here, for the grammar
itself (the worker's result is dearer to bring back than to remake: see compile_worker).
"""
import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from minivllm.errors import InvalidParameter
from minivllm.structured.compile_worker import CompileTimeout, WorkerDied, WorkerPool
from minivllm.structured.matcher import SurrogateGuard
from minivllm.structured.params import StructuredOutputsParams

# Keywords xgrammar 0.2 accepts and does not enforce (checked by compiling schemas that use
# them and reading the grammar it makes): an output could break them.
UNSUPPORTED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "propertyNames", "not", "if",
                        "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                        "unevaluatedItems", "unevaluatedProperties")
# Keys whose value maps names to schemas (so the names are not keywords).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# Keywords whose strings may need the JSON token filter (see GrammarCompiler.token_filter).
FILTERED_KEYWORDS = ("minLength", "maxLength", "pattern", "format", "patternProperties")
MAX_SCHEMA_DEPTH = 64  # objects and arrays inside each other (real schemas nest a few; $ref recursion costs none)
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
CACHE_BYTES = 512 * 2**20  # and at most this much of them (a grammar holds its token masks)
COMPILE_THREADS = 2  # compiles at once (``submit``; also the worker processes); more wait their turn
# A spec's trial compile is stopped past this. Big real specs take about 2 s with Qwen's 151k
# vocabulary on a busy CPU (tool_choice="required" over 20 tools, 14 kB: 1.6 s; over 85, 61 kB:
# 1.9 s; an object of 400 properties: 1.8 s); the limit leaves five times that, and holds a
# worker no longer than a client would wait.
COMPILE_TIMEOUT_S = 10.0


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary, and caches what it compiled. Safe to
    call from several threads (xgrammar's compiler is; the cache is guarded): ``compile``
    compiles on the caller's thread, ``submit`` on the compiler's own, and two callers who
    ask for one spec at once share one compile. Each compile is tried first in a worker
    process, within ``compile_timeout_s`` (None: no trial and no limit); ``shutdown`` ends
    the workers (so does the interpreter's exit, and their parent's death)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1,
                 cache_size: int = CACHE_SIZE, cache_bytes: int = CACHE_BYTES,
                 compile_timeout_s: float | None = COMPILE_TIMEOUT_S):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids))
        # Our cache only, so that what a compile costs is visible (compile_seconds).
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self.cache: OrderedDict = OrderedDict()  # key -> CompiledGrammar, least recently used first
        self.cached_bytes = 0
        self.compiling: dict[tuple, Future] = {}  # key -> the compile under way
        self.lock = threading.Lock()
        self.executor: ThreadPoolExecutor | None = None  # made at the first submit
        self.hits = self.misses = 0
        self.compile_seconds: list[float] = []  # one entry per compile (a cache miss): see _compile
        self.json_filters: dict[bool, torch.Tensor] = {}  # see token_filter
        self.surrogate_guards: dict[int, SurrogateGuard] = {}  # by id(token_filter): see surrogate_guard
        self.compile_timeout_s = compile_timeout_s
        # Started at the first trial; killed with this compiler, or at exit.
        self.workers = WorkerPool(self.tokenizer_info.serialize_json(), COMPILE_THREADS)
        weakref.finalize(self, self.workers.shutdown)

    def shutdown(self) -> None:
        """End the worker processes. A compile under way or asked for later fails."""
        self.workers.shutdown()
        with self.lock:
            executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown(wait=False)  # (what it holds ends soon: a trial now fails at once)

    def token_filter(self, params: StructuredOutputsParams) -> "torch.Tensor | None":
        """For a JSON schema that needs it, the tokens that spell no control character (bytes
        0x00-0x1f) and no surrogate (``has_surrogate``; across two tokens: ``surrogate_guard``),
        as a bitmask row to AND with the grammar's; None for the other kinds and
        schemas. JSON allows none of them raw (inside a string they are escaped; between
        tokens only whitespace), but xgrammar 0.2's grammar for a string with minLength or
        maxLength admits them (mlc-ai/xgrammar#800), and a strict parser then refuses the
        output. Its plain string, its whitespace, enum and const values and property names
        admit none (tests/test_structured_output.py walks them), so a schema without
        FILTERED_KEYWORDS anywhere (a pattern or a format too, to be safe) goes without: the
        AND is a pass over the whole batch's bitmask at every step. With
        ``disable_any_whitespace=False`` tab, newline and carriage return stay allowed, as
        whitespace between tokens (a raw tab inside a bounded string is then still possible)."""
        if params.kind != "json" or not uses_keyword(json.loads(params.json), FILTERED_KEYWORDS):
            return None
        compact = params.disable_any_whitespace
        with self.lock:
            if compact not in self.json_filters:
                whitespace = () if compact else (0x09, 0x0A, 0x0D)
                banned = [i for i, spelling in enumerate(self.tokenizer_info.decoded_vocab[: self.vocab_size])
                          if any(b < 0x20 and b not in whitespace for b in spelling) or has_surrogate(spelling)]
                self.json_filters[compact] = pack_bitmask(banned, self.vocab_size)
            return self.json_filters[compact]

    def surrogate_guard(self, params: StructuredOutputsParams) -> "SurrogateGuard | None":
        """Where ``token_filter`` applies, what keeps a surrogate out across two tokens: the
        grammar's strings take the bytes ED A0-BF xx (a UTF-16 surrogate, which UTF-8 forbids)
        as one character where the text's decoding makes three replacement characters of
        them, so a bounded string's length breaks its bound. After a token that ends in ED
        no token may begin with A0-BF."""
        token_filter = self.token_filter(params)
        if token_filter is None:
            return None
        with self.lock:
            guard = self.surrogate_guards.get(id(token_filter))
            if guard is None:
                vocab = self.tokenizer_info.decoded_vocab[: self.vocab_size]
                tails = [i for i, spelling in enumerate(vocab) if spelling[:1] and 0xA0 <= spelling[0] <= 0xBF]
                no_tail = pack_bitmask(tails, self.vocab_size)
                ends_in_lead = frozenset(i for i, spelling in enumerate(vocab) if spelling.endswith(b"\xed"))
                guard = self.surrogate_guards[id(token_filter)] = SurrogateGuard(ends_in_lead, token_filter & no_tail)
            return guard

    def lookup(self, params: StructuredOutputsParams):
        """The CompiledGrammar of ``params`` if it is in the cache, else None (never compiles)."""
        with self.lock:
            compiled = self.cache.get(params.key)
            if compiled is not None:
                self.cache.move_to_end(params.key)
                self.hits += 1
            return compiled

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar of ``params`` (from the cache when it has been compiled), on
        this thread; InvalidParameter if it cannot be."""
        compiled = self.lookup(params)
        if compiled is not None:
            return compiled
        future, mine = self._claim(params.key)
        if mine:
            self._run(params, future)
        return future.result()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The same on the compiler's threads: a future of the CompiledGrammar (done at once
        when it is cached)."""
        compiled = self.lookup(params)
        if compiled is not None:
            done: Future = Future()
            done.set_result(compiled)
            return done
        future, mine = self._claim(params.key)
        if mine:
            with self.lock:
                if self.executor is None:
                    self.executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="minivllm-grammar")
            self.executor.submit(self._run, params, future)
        return future

    def _claim(self, key) -> tuple[Future, bool]:
        """The future of ``key``'s compile, and whether the caller is to run it."""
        with self.lock:
            if key in self.cache:  # (compiled since the lookup)
                done: Future = Future()
                done.set_result(self.cache[key])
                return done, False
            if key in self.compiling:
                return self.compiling[key], False
            future = self.compiling[key] = Future()
            future.set_running_or_notify_cancel()  # shared by every caller: none may cancel it
            return future, True

    def _run(self, params: StructuredOutputsParams, future: Future) -> None:
        key = params.key
        try:
            compiled, seconds = self._compile(params)
        except BaseException as e:  # handed to every caller waiting on it
            with self.lock:
                del self.compiling[key]
            future.set_exception(e)
            return
        with self.lock:
            del self.compiling[key]
            self.misses += 1
            self.compile_seconds.append(seconds)
            self.cache[key] = compiled
            self.cached_bytes += compiled.memory_size_bytes
            # The newest always stays: the request that asked for it is about to use it.
            while len(self.cache) > 1 and (len(self.cache) > self.cache_size or self.cached_bytes > self.cache_bytes):
                _, dropped = self.cache.popitem(last=False)
                self.cached_bytes -= dropped.memory_size_bytes
        future.set_result(compiled)

    def _compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar of ``params``, and the seconds its compiles took (the trial's and
        this one's, without the wait for a worker)."""
        kind = params.kind
        if kind == "json":
            check_schema(parse_schema(params.json))
        method, args, kwargs = call = xgrammar_call(params)
        trial = self._trial(params, call, self.compile_timeout_s) if self.compile_timeout_s is not None else 0.0
        start = time.perf_counter()
        try:
            compiled = getattr(self.compiler, method)(*args, **kwargs)
        except RuntimeError as e:  # xgrammar's parse errors
            raise invalid(kind, str(e)) from None
        if not self.first_tokens(compiled).any():
            # (``root ::= root``: valid EBNF, but no output can ever start; sampling would
            # have nothing to draw from)
            raise invalid(kind, "it admits no output at all (not even an empty one)")
        return compiled, trial + time.perf_counter() - start

    def first_tokens(self, compiled) -> torch.Tensor:
        """The tokens the grammar allows as an output's first ([vocab] bool; EOS among them
        when the empty output is allowed)."""
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return ((bitmask[0].unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[: self.vocab_size].bool()

    def _trial(self, params: StructuredOutputsParams, call: tuple, timeout_s: float) -> float:
        """Compile ``call`` in a worker process (the seconds it took); raise InvalidParameter if
        it takes longer than ``timeout_s``, if xgrammar refuses it, or if it kills the worker.
        (Any other error the compile here raises again.)"""
        kind, what = params.kind, DESCRIPTION[params.kind]
        try:
            seconds, error = self.workers.trial(call, timeout_s)
        except CompileTimeout:
            raise InvalidParameter(
                f"SamplingParams.structured_outputs.{kind}: the {what} did not compile within the limit of "
                f"{timeout_s:g} s (compile_timeout_s) and was stopped: simplify it", "structured_outputs") from None
        except WorkerDied as e:
            if self.workers.closed:  # (killed by shutdown, not by the spec)
                raise RuntimeError("the grammar compiler has been shut down") from None
            raise InvalidParameter(f"SamplingParams.structured_outputs.{kind}: the {what} could not be compiled: "
                                   f"the grammar compiler's process ended ({e})", "structured_outputs") from None
        if error is not None and error[0]:
            raise invalid(kind, error[1])
        return seconds


def xgrammar_call(params: StructuredOutputsParams) -> tuple[str, tuple, dict]:
    """The call of xgrammar's GrammarCompiler that compiles ``params``: (method, args, kwargs)."""
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    if kind == "json":
        return "compile_json_schema", (params.json,), {"any_whitespace": any_whitespace}
    if kind == "json_object":
        return "compile_json_schema", ('{"type": "object"}',), {"any_whitespace": any_whitespace}
    if kind == "regex":
        return "compile_regex", (params.regex,), {}
    if kind == "choice":
        return "compile_grammar", (choice_grammar(params.choice),), {}
    return "compile_grammar", (params.grammar,), {}


def invalid(kind: str, xgrammar_error: str) -> InvalidParameter:
    return InvalidParameter(f"SamplingParams.structured_outputs.{kind}: invalid {DESCRIPTION[kind]}: "
                            f"{xgrammar_message(xgrammar_error)}", "structured_outputs")


def has_surrogate(spelling: bytes) -> bool:
    """Does a token's spelling hold a UTF-16 surrogate's UTF-8 bytes (ED A0-BF), which no
    UTF-8 text may?"""
    return any(b == 0xED and 0xA0 <= nxt <= 0xBF for b, nxt in zip(spelling, spelling[1:]))


def pack_bitmask(banned: list[int], vocab_size: int) -> torch.Tensor:
    """One bitmask row ([ceil(vocab / 32)] int32) that allows every token but ``banned``."""
    words = (vocab_size + 31) // 32
    allowed = torch.ones(words * 32, dtype=torch.bool)
    allowed[banned] = False
    packed = (allowed.view(words, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # (two's complement)


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


def check_schema(schema, path: str = "#", depth: int = 0) -> None:
    """Refuse a schema that uses a keyword xgrammar would not enforce, naming it and where,
    or that nests deeper than MAX_SCHEMA_DEPTH."""
    if not isinstance(schema, (dict, list)):
        return
    depth += 1
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidParameter(f"SamplingParams.structured_outputs.json: the JSON schema nests deeper than "
                               f"{MAX_SCHEMA_DEPTH} levels (at {path})", "structured_outputs")
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema(item, f"{path}/{i}", depth)
        return
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    shape = next((k for k in ("pattern", "format") if k in schema), None)
    if lengths and shape:  # xgrammar keeps the pattern or format and drops the lengths
        unsupported(f"{' and '.join(map(repr, lengths))} together with {shape!r} (at {path})")
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
                check_schema(sub, f"{where}/{name}", depth)
        elif isinstance(value, (dict, list)) and key not in ("enum", "const", "default", "examples", "required"):
            check_schema(value, where, depth)


def uses_keyword(schema, keywords: tuple[str, ...]) -> bool:
    """Does any object in ``schema`` have one of ``keywords`` as a key (a property of that
    name too: erring towards yes)?"""
    if isinstance(schema, dict):
        return any(k in keywords for k in schema) or any(uses_keyword(v, keywords) for v in schema.values())
    if isinstance(schema, list):
        return any(uses_keyword(v, keywords) for v in schema)
    return False


def unsupported(what: str) -> None:
    raise InvalidParameter(f"SamplingParams.structured_outputs.json: unsupported JSON schema feature: {what} "
                           "is not enforced by the grammar engine", "structured_outputs")


def xgrammar_message(error: str) -> str:
    """xgrammar's message without its log prefix ("[12:08:38] /project/cpp/x.cc:83: ")."""
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", error.strip())
    return text.splitlines()[0] if text else "RuntimeError"
