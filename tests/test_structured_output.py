"""Structured output (chapter 18) on the bundled model, which knows no JSON: only the grammar
can make its outputs valid. Every mode (JSON schema, any JSON object, regex, choice, EBNF) is
checked over many seeds by parsing and validating what comes out; then the engine's paths
under constraints: batching beside unconstrained requests, chunked prefill, preemption,
n > 1, stop strings, max_tokens, streaming, and the asynchronous scheduler (greedy outputs
identical with it on and off). Bad specs are refused with the problem named.
"""
import itertools
import json
import re
import threading

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.ops.token_bitmask import apply_token_bitmask_reference, unpack_bitmask
from minivllm.sampling_params import InvalidParameter
from minivllm.structured import StructuredOutputsParams
from minivllm.structured.compiler import has_surrogate
from minivllm.structured.feature import StructuredOutputs
from minivllm.structured.matcher import GrammarState, fill_bitmask
from minivllm.structured.trie import ChoiceConstraint, vocab_bytes

pytestmark = pytest.mark.usefixtures("one_thread")
# On the CPU a row's logits do not depend on the rest of its batch, so outputs can be compared
# token for token across batch compositions; on a GPU (bfloat16, kernels tiled by batch size)
# the last bits may, and a greedy tie can go either way: there, outputs are checked for validity.
BATCH_INVARIANT = not torch.cuda.is_available()
# On a GPU an engine sized by memory takes 90% of the card, and the tests that build a second
# engine beside the module's found none left: there each takes a fixed pool (64k tokens).
POOL = {"num_kv_blocks": 4096} if torch.cuda.is_available() else {}

# Every value bounded, so that a complete object fits in max_tokens whatever the model does.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "member", "color", "tags", "address"],
}
PROMPTS = ["The old man said", "Once upon a time", "It was the best of times", "Call me Ishmael."]
SEEDS = range(12)


@pytest.fixture(scope="module")
def llm():
    return LLM(async_scheduling=False, **POOL)


def run(llm, structured, n_seeds=len(SEEDS), max_tokens=160, **kwargs):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=structured, **kwargs)
              for s in range(n_seeds)]
    prompts = [PROMPTS[s % len(PROMPTS)] for s in range(n_seeds)]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schema_outputs_validate(llm):
    outs = run(llm, StructuredOutputsParams(json=PERSON))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
        # Compact: outside its strings, the only whitespace is the one space after "," and ":".
        skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text)
        assert not re.search(r"\s", skeleton.replace(", ", ",").replace(": ", ":")), out.text
    # And the model on its own writes no JSON at all.
    plain = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=0, max_tokens=40), use_tqdm=False)
    assert not any(o.outputs[0].text.lstrip().startswith("{") for o in plain)


def test_json_schema_as_dict_or_text_compiles_once(llm):
    compiler = llm.engine.grammar_compiler()
    misses = compiler.misses
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for spec in (schema, json.dumps(schema)):
        for out in run(llm, StructuredOutputsParams(json=spec), n_seeds=3):
            assert json.loads(out.text).keys() == {"ok"}
    assert compiler.misses == misses + 1  # the dict and its text are one spec: compiled once


def test_json_object(llm):
    outs = run(llm, StructuredOutputsParams(json_object=True), max_tokens=48)
    for out in outs:
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # a free-form object may go on past max_tokens: reported as length
            assert out.finish_reason == "length" and len(out.token_ids) == 48


def test_regex(llm):
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{2,3}( (yes|no))?"
    for out in run(llm, StructuredOutputsParams(regex=pattern)):
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, out.text), out.text


def test_choice(llm):
    choices = ["positive", "negative", 'a "quoted" one', "naïve café"]
    texts = {out.text for out in run(llm, StructuredOutputsParams(choice=choices), n_seeds=24)}
    assert texts <= set(choices) and len(texts) >= 2


def test_ebnf_grammar(llm):
    grammar = 'root ::= "(" item (" " item){0,3} ")"\nitem ::= [a-z]{1,5} | [0-9]{1,2}'
    for out in run(llm, StructuredOutputsParams(grammar=grammar)):
        assert out.finish_reason == "stop"
        assert re.fullmatch(r"\((?:[a-z]{1,5}|[0-9]{1,2})(?: (?:[a-z]{1,5}|[0-9]{1,2})){0,3}\)", out.text), out.text


def test_greedy_too(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=160,
                                                  structured_outputs=StructuredOutputsParams(json=PERSON)),
                       use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), PERSON)


def test_max_tokens_is_respected_and_reported_as_length(llm):
    for out in run(llm, StructuredOutputsParams(json=PERSON), n_seeds=4, max_tokens=5):
        assert out.finish_reason == "length" and len(out.token_ids) == 5
        assert '{"name": "'.startswith(out.text) or out.text.startswith('{"name": "')


def test_stop_string_ends_a_constrained_output(llm):
    for out in run(llm, StructuredOutputsParams(json=PERSON), n_seeds=4, stop=['"age"']):
        assert out.finish_reason == "stop" and out.stop_reason == '"age"'
        assert out.text.startswith('{"name": "') and '"age"' not in out.text


def test_constrained_beside_unconstrained_requests(llm):
    """One batch: the mask applies to its own rows only; the others come out as they would alone."""
    plain = SamplingParams(temperature=0, max_tokens=30)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    constrained = SamplingParams(temperature=0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=PERSON))
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 4 + [constrained] * 4, use_tqdm=False)
    if BATCH_INVARIANT:
        assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(len(o.outputs[0].token_ids) == 30 or o.outputs[0].finish_reason == "stop" for o in mixed[:4])
    for o in mixed[4:]:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_the_feature_forgets_a_grammar_when_its_completion_ends():
    """Structured output keeps each completion's grammar state itself, from its compile to its
    end: finished, aborted mid-run or stopped by its length, none is left behind."""
    llm = LLM(async_scheduling=True, **POOL)
    engine = llm.engine
    spec = StructuredOutputsParams(json=PERSON)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=160, structured_outputs=spec, n=2),
                 use_tqdm=False)
    assert engine.structured.grammars == {}, "finished completions keep no grammar"
    for i, max_tokens in enumerate([160, 3]):
        engine.add_request(list(range(10, 30)), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                               structured_outputs=spec), f"held{i}")
    engine.step()
    engine.step()
    assert engine.structured.grammars, "a running constrained request has its grammar"
    engine.abort_request("held0")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.structured.grammars == {}, "an aborted request and a length-stopped one keep none"


def test_n_completions_each_follow_the_grammar(llm):
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=160,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    [out] = llm.generate(PROMPTS[1], params, use_tqdm=False)
    assert len(out.outputs) == 4
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1  # four walks through the grammar, not one copied


def greedy_structured_workload():
    specs = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{2,5}){1,4}"),
             StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]), None,
             StructuredOutputsParams(grammar='root ::= "<" [a-z ]{4,30} ">"'), StructuredOutputsParams(json_object=True)]
    prompts = [f"{PROMPTS[i % 4]} {'and so on ' * (i % 5)}" for i in range(18)]
    params = [SamplingParams(temperature=0, max_tokens=120 if i % 6 != 5 else 40, structured_outputs=specs[i % 6])
              for i in range(18)]
    return prompts, params


def token_ids(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


def test_async_scheduling_gives_the_same_greedy_outputs():
    """The asynchronous engine samples a constrained step only once the step before it is
    processed (its forward pass goes ahead): the outputs are the synchronous loop's. In
    float32: the overlapped loop still schedules a sequence for the step after the one that
    finished it, and on a GPU a batch of another size rounds a bfloat16 near-tie its own way."""
    prompts, params = greedy_structured_workload()
    sync = LLM(dtype="float32", async_scheduling=False, **POOL).generate(prompts, params, use_tqdm=False)
    asynchronous = LLM(dtype="float32", async_scheduling=True, **POOL)
    deferred = []
    original = asynchronous.engine.overlap.sample_deferred
    asynchronous.engine.overlap.sample_deferred = lambda step: (deferred.append(len(step.requests)), original(step))
    outs = asynchronous.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(sync)
    assert len(deferred) > 10  # the deferred path ran
    check_valid(outs, params)


def check_valid(outputs, params) -> None:
    """Each finished output of greedy_structured_workload follows its spec."""
    for o, p in zip(outputs, params):
        so, out = p.structured_outputs, o.outputs[0]
        if so is None or out.finish_reason != "stop":
            continue
        if so.json is not None:
            jsonschema.validate(json.loads(out.text), PERSON)
        elif so.regex is not None:
            assert re.fullmatch(so.regex, out.text), out.text
        elif so.choice is not None:
            assert out.text in so.choice
        elif so.grammar is not None:
            assert re.fullmatch(r"<[a-z ]{4,30}>", out.text), out.text
        else:
            assert isinstance(json.loads(out.text), dict)


def test_preemption_and_chunked_prefill_under_constraints():
    """A KV pool too small for the batch (sequences are preempted and recomputed) and a token
    budget smaller than the prompts (chunked prefill): the same greedy outputs, still valid."""
    prompts, params = greedy_structured_workload()
    reference = LLM(async_scheduling=False, **POOL).generate(prompts, params, use_tqdm=False)
    for async_scheduling in (False, True):
        llm = LLM(async_scheduling=async_scheduling, num_kv_blocks=24, block_size=16, max_num_batched_tokens=24,
                  record_trace=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert sum(len(r.preempted) for r in llm.engine.trace) > 0
        if BATCH_INVARIANT:
            assert token_ids(outs) == token_ids(reference)
        check_valid(outs, params)


def test_streaming_a_constrained_output(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=160, structured_outputs=StructuredOutputsParams(json=PERSON))
    pieces = list(llm.stream(PROMPTS[2], params))
    assert len(pieces) > 5
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


# -- bad specs ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec,expected", [
    (dict(json="{not json"), "not valid JSON"),
    (dict(json={"type": "strin"}), 'Unsupported type "strin"'),
    (dict(json={"type": "array", "uniqueItems": True}), "unsupported JSON schema feature: the keyword 'uniqueItems'"),
    (dict(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "at #/properties/a/not"),
    (dict(json={"$ref": "https://example.com/s.json"}), "a $ref outside the schema"),
    (dict(json={"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}),
     "unsupported JSON schema feature: 'maxLength' together with 'pattern' (at #)"),
    (dict(json={"type": "object", "properties": {"e": {"type": "string", "format": "email", "minLength": 3}}}),
     "'minLength' together with 'format' (at #/properties/e)"),
    (dict(regex="(ab"), "invalid regular expression: Regex parsing error"),
    (dict(grammar='root ::= "a" |'), "invalid EBNF grammar"),
    (dict(grammar='start ::= "a"'), 'root rule with name "root" is not found'),
])
def test_invalid_specs_are_refused_by_name(llm, spec, expected):
    with pytest.raises(InvalidParameter, match=re.escape(expected)) as e:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()
    # The engine is untouched: the next request runs.
    assert llm.generate("x", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_bad_spec_in_a_batch_queues_nothing(llm):
    good = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    bad = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[a-"))
    with pytest.raises(InvalidParameter):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("fields,expected", [
    (dict(), "give exactly one of json, regex, choice, grammar, json_object (got none)"),
    (dict(json={}, regex="a"), "(got json, regex)"),
    (dict(choice=[]), "choice must be a list of 1 to"),
    (dict(choice=["a", ""]), "non-empty strings"),
    (dict(regex=3), "regex must be a non-empty string"),
    (dict(json="x" * 70000), "at most 65536 characters"),
])
def test_params_are_checked(fields, expected):
    with pytest.raises(InvalidParameter, match=re.escape(expected)):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_a_dict_and_refuse_what_cannot_work():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    with pytest.raises(InvalidParameter, match="fields of StructuredOutputsParams"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(InvalidParameter, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    with pytest.raises(InvalidParameter, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})


# -- masks -------------------------------------------------------------------------------


def test_bitmask_reference_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 31), (3, 32), (5, 1000), (4, 8192)]:
        bitmask = torch.randint(-2**31, 2**31, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
        logits = torch.randn(rows, vocab, generator=g)
        expected = logits.clone()
        for r in range(rows):  # bit by bit, the slow way
            for t in range(vocab):
                if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                    expected[r, t] = float("-inf")
        out = apply_token_bitmask_reference(logits.clone(), bitmask)
        assert torch.equal(out, expected)


def test_matcher_masks_match_the_trie_constraint(llm):
    """The by-hand choice constraint over a token trie allows exactly the tokens xgrammar's
    matcher allows, at every step of a real walk."""
    tokenizer, vocab = llm.get_tokenizer(), llm.engine.runner.model_config.vocab_size
    choices = ["the cat", "the dog", "a bird", "then"]
    by_hand = ChoiceConstraint(choices, vocab_bytes(tokenizer, vocab), stop_token_id=0)
    state = GrammarState(llm.engine.grammar_compiler().compile(StructuredOutputsParams(choice=choices)))
    generated = b""
    for token in tokenizer.encode("the dog", add_special_tokens=False) + [0]:
        xgr_allowed = unpack_bitmask(fill_bitmask([state], vocab), vocab)[0]
        assert torch.equal(xgr_allowed, by_hand.mask(generated))
        assert state.accept(token)
        generated += bytes(vocab_bytes(tokenizer, vocab)[token])
    assert state.is_terminated


def test_rebuilt_matcher_allows_what_the_live_one_does(llm):
    out = run(llm, StructuredOutputsParams(json=PERSON), n_seeds=1, max_tokens=20)[0]
    compiled = llm.engine.grammar_compiler().compile(StructuredOutputsParams(json=PERSON))
    live = GrammarState(compiled)
    for t in out.token_ids:
        assert live.accept(t)
    rebuilt = GrammarState.rebuild(compiled, out.token_ids)
    vocab = llm.engine.runner.model_config.vocab_size
    assert torch.equal(fill_bitmask([live], vocab), fill_bitmask([rebuilt], vocab))
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        GrammarState.rebuild(compiled, [out.token_ids[0], out.token_ids[0]])  # "{{" is no JSON


def test_a_large_batch_fills_on_threads_what_row_by_row_fills(llm):
    """From BATCH_FILL_ROWS rows the matchers fill through xgrammar's batch matcher: the same
    bits as one row at a time, rows without a grammar or finished left all ones."""
    from minivllm.structured import matcher

    out = run(llm, StructuredOutputsParams(json=PERSON), n_seeds=1, max_tokens=20)[0]
    compiled = llm.engine.grammar_compiler().compile(StructuredOutputsParams(json=PERSON))
    states = []
    for i in range(12):  # grammars at different points of the same output, and empty rows
        state = GrammarState(compiled)
        for t in out.token_ids[: i * 2]:
            assert state.accept(t)
        states.append(state if i % 4 else None)
    vocab = llm.engine.runner.model_config.vocab_size
    batched = fill_bitmask(states, vocab)
    assert len([s for s in states if s]) >= matcher.BATCH_FILL_ROWS
    for row, state in enumerate(states):
        one = fill_bitmask([state], vocab)[0]  # below the threshold: row by row
        assert torch.equal(batched[row], one), row
    assert (batched[0] == -1).all() and not (batched[1] == -1).all()


# -- JSON has no raw control characters ----------------------------------------------------------

BOUNDED = {"type": "object", "properties": {"word": {"type": "string", "minLength": 1, "maxLength": 8},
                                            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                     "maxItems": 2}},
           "required": ["word", "tags"]}


def test_json_outputs_parse_strictly_with_length_bounded_strings(tiny_qwen3_with_tokenizer):
    """xgrammar 0.2 lets a string with minLength or maxLength hold raw control characters
    (mlc-ai/xgrammar#800), which no strict JSON parser accepts. A random model whose
    vocabulary spells them (this tiny one's byte tokens) writes them whenever it may: the
    engine's token filter must keep them out."""
    llm = LLM(str(tiny_qwen3_with_tokenizer), async_scheduling=False, num_kv_blocks=256)
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=80, structured_outputs=StructuredOutputsParams(
        json=BOUNDED)) for s in range(24)]
    outs = [o.outputs[0] for o in llm.generate(["a b c"] * 24, params, use_tqdm=False)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 12
    for out in finished:
        jsonschema.validate(json.loads(out.text), BOUNDED)  # json.loads is strict: a raw control character fails
    assert all(ord(ch) >= 0x20 for out in outs for ch in out.text)


def test_a_bounded_string_takes_no_surrogate_bytes(tiny_qwen3_with_tokenizer):
    """The grammar's strings take ED A0-BF xx, a UTF-16 surrogate's UTF-8 bytes, as one
    character; the text's decoding makes three replacement characters of them, and a string
    at its maxLength is then over it. These seeds drew such bytes (this model's byte tokens)
    before the engine's surrogate guard."""
    llm = LLM(str(tiny_qwen3_with_tokenizer), async_scheduling=False, num_kv_blocks=256)
    seeds = [140, 151, 181, 254, 353]
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=80, structured_outputs=StructuredOutputsParams(
        json=BOUNDED)) for s in seeds]
    outs = [o.outputs[0] for o in llm.generate(["a b c"] * len(seeds), params, use_tqdm=False)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 3
    for out in finished:
        jsonschema.validate(json.loads(out.text), BOUNDED)
    assert not any("\ufffd" in out.text for out in outs), [out.text for out in outs]
    compiler = llm.engine.grammar_compiler()
    spelling = compiler.tokenizer_info.decoded_vocab
    guard = compiler.surrogate_guard(StructuredOutputsParams(json=BOUNDED))
    vocab = llm.engine.runner.model_config.vocab_size
    allowed_after = unpack_bitmask(guard.after_lead.unsqueeze(0), vocab)[0]
    assert guard.ends_in_lead and all(spelling[t].endswith(b"\xed") for t in guard.ends_in_lead)
    assert not any(allowed_after[t] for t in range(vocab) if spelling[t][:1] and 0xA0 <= spelling[t][0] <= 0xBF)
    assert any(allowed_after[t] for t in range(vocab) if spelling[t][:1] and 0x80 <= spelling[t][0] <= 0x9F)
    assert compiler.surrogate_guard(StructuredOutputsParams(regex="[a-z]+")) is None


def test_the_json_token_filter_bans_exactly_the_tokens_that_spell_control_characters(llm):
    compiler = llm.engine.grammar_compiler()
    vocab = llm.engine.runner.model_config.vocab_size
    spellings = compiler.tokenizer_info.decoded_vocab
    for compact, whitespace in ((True, set()), (False, {9, 10, 13})):
        allowed = unpack_bitmask(compiler.token_filter(StructuredOutputsParams(
            json=BOUNDED, disable_any_whitespace=compact)).unsqueeze(0), vocab)[0]
        banned = [any(b < 0x20 and b not in whitespace for b in spelling) or has_surrogate(spelling)
                  for spelling in spellings]
        expected = torch.tensor([not banned[t] if t < len(spellings) else True for t in range(vocab)])
        assert torch.equal(allowed, expected) and not expected.all()
    assert compiler.token_filter(StructuredOutputsParams(regex="[\x01-\x7f]+")) is None  # a regex says what it wants


def test_the_batch_bitmask_is_each_rows_own(llm):
    """fill_bitmask ANDs the token filters of a batch at once: each row must still be what its
    own state writes (its grammar, then its filter), and a row without a grammar all ones."""
    compiler, tokenizer = llm.engine.grammar_compiler(), llm.get_tokenizer()
    vocab = llm.engine.runner.model_config.vocab_size
    specs = [StructuredOutputsParams(json=BOUNDED), StructuredOutputsParams(json=BOUNDED, disable_any_whitespace=False),
             StructuredOutputsParams(regex="[a-z ]{1,9}")]
    states = []
    for spec, prefix in zip(specs, ['{"word": "ab', '{"word": "a', "ab"]):
        state = GrammarState(compiler.compile(spec), compiler.token_filter(spec))
        for t in tokenizer.encode(prefix, add_special_tokens=False):
            assert state.accept(t)
        states.append(state)
    from minivllm.structured.matcher import BATCH_FILL_ROWS

    rows = [states[0], None, states[1], states[2], states[0]]
    for batch_rows in (rows, rows * 2):  # row by row, and on xgrammar's batch matcher
        assert (sum(s is not None for s in batch_rows) >= BATCH_FILL_ROWS) == (batch_rows is not rows)
        batch = fill_bitmask(batch_rows, vocab)
        for row, state in enumerate(batch_rows):
            alone = torch.full_like(batch[:1], -1)
            if state is not None:
                state.fill(alone, 0)
            assert torch.equal(batch[row], alone[0]), row
    assert (batch[1] == -1).all()
    # Row 0 is inside a bounded string, where xgrammar alone would allow control characters.
    unfiltered = GrammarState(states[0].compiled)
    for t in tokenizer.encode('{"word": "ab', add_special_tokens=False):
        unfiltered.accept(t)
    grammar = unpack_bitmask(fill_bitmask([unfiltered], vocab), vocab)[0]
    token_filter = unpack_bitmask(states[0].token_filter.unsqueeze(0), vocab)[0]
    assert (grammar & ~token_filter).any()
    assert torch.equal(unpack_bitmask(batch[:1], vocab)[0], grammar & token_filter)


def test_a_state_in_several_rows_is_filled_once(llm, monkeypatch):
    """One matcher in several rows of the batch matcher (two threads filling it at once share
    its scratch buffers and crashed the process): its row is filled once and copied. Run on
    as many threads as the machine gives (on one core there is no race to lose)."""
    from minivllm.structured import matcher

    monkeypatch.setattr(matcher, "fill_threads", lambda: 8)
    monkeypatch.setattr(matcher, "_per_thread", threading.local())  # a batch matcher with those threads
    compiler, tokenizer = llm.engine.grammar_compiler(), llm.get_tokenizer()
    vocab = llm.engine.runner.model_config.vocab_size
    state = GrammarState(compiler.compile(StructuredOutputsParams(json=BOUNDED)))
    for t in tokenizer.encode('{"word": "ab', add_special_tokens=False):
        assert state.accept(t)
    alone = fill_bitmask([state], vocab)[0]
    rows = [state] * 8 + [None] + [state] * 8
    for _ in range(100):
        batch = fill_bitmask(rows, vocab)
        assert all(torch.equal(batch[row], alone) for row, s in enumerate(rows) if s is not None)
        assert (batch[8] == -1).all()
    with pytest.raises(ValueError, match="appears twice"):
        matcher.accept_tokens([state] * 8, [tokenizer.encode("c", add_special_tokens=False)[0]] * 8)


def test_a_batch_accepts_on_threads_what_one_by_one_accepts(llm):
    """From BATCH_FILL_ROWS rows the grammars take their tokens through xgrammar's batch
    matcher: the same verdicts as one at a time, a refused token leaving its state as it was."""
    from minivllm.structured import matcher

    out = run(llm, StructuredOutputsParams(json=PERSON), n_seeds=1, max_tokens=20)[0]
    compiled = llm.engine.grammar_compiler().compile(StructuredOutputsParams(json=PERSON))
    vocab = llm.engine.runner.model_config.vocab_size

    def walked(i):
        state = GrammarState(compiled)
        for t in out.token_ids[:i]:
            assert state.accept(t)
        return state

    positions = list(range(12))
    tokens = [out.token_ids[i] if i % 3 else out.token_ids[0] for i in positions]  # "{" again: refused after the first
    batched, single = [walked(i) for i in positions], [walked(i) for i in positions]
    assert len(batched) >= matcher.BATCH_FILL_ROWS
    got = matcher.accept_tokens(batched, tokens)
    assert got == [s.accept(t) for s, t in zip(single, tokens)]
    assert True in got and False in got[1:]  # the batch holds both verdicts, so both are compared
    for a, b in zip(batched, single):
        assert a.num_accepted == b.num_accepted
        assert torch.equal(fill_bitmask([a], vocab), fill_bitmask([b], vocab))


def test_a_token_its_grammar_refuses_fails_that_request_alone(monkeypatch):
    """If a sampled token were one the grammar does not allow (the mask prevents it; here the
    mask is switched off), that request ends with finish_reason "error" and its message, and
    the unconstrained request beside it runs to its end: with enough constrained rows for the
    batch path and with one."""
    engine_llm = LLM(async_scheduling=False, num_kv_blocks=512)
    engine = engine_llm.engine
    monkeypatch.setattr(StructuredOutputs, "bitmask", lambda self, requests: None)  # no mask: the model is free
    choice = StructuredOutputsParams(choice=["qqqq"])
    for constrained in (1, 9):
        params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice)] * constrained
        params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        outs = engine_llm.generate(["The letter said"] * len(params), params, use_tqdm=False)
        for o in outs[:-1]:
            assert o.outputs[0].finish_reason == "error" and "not allowed by the grammar" in o.error, o.outputs[0]
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 8


# -- the engine's bitmask: buffers kept from step to step ------------------------------------


def engine_stand_in(vocab_size, device="cpu"):
    """The engine's structured-output feature, alone: all its bitmask reads is the vocabulary
    size and whether its buffers are pinned."""
    return StructuredOutputs(None, vocab_size, set(), device != "cpu", None, {}, None, None)


STAND_IN_IDS = itertools.count(1)


def request_stand_in(engine, grammar, finished=False):
    """A completion the feature ``engine`` holds ``grammar`` for (None: an unconstrained one)."""
    from types import SimpleNamespace

    seq = SimpleNamespace(seq_id=next(STAND_IN_IDS), is_finished=finished)
    if grammar is not None:
        engine.grammars[seq.seq_id] = grammar
    return SimpleNamespace(grammar=grammar, seq=seq)


def alone(state, vocab):
    """The row ``state`` gets in a fresh bitmask of its own (all ones without a grammar)."""
    row = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    if state is not None:
        state.fill(row, 0)
    return row[0]


def test_a_reused_bitmask_buffer_never_leaks_an_earlier_mask(llm):
    """The engine fills its bitmask into buffers it keeps: whatever a buffer held (here
    garbage written into every buffer after every step), each row of a step is what its own
    state writes alone, a row without a live grammar all ones, over steps that grow and
    shrink the batch, on the batch matcher's path and row by row."""
    compiler, tokenizer = llm.engine.grammar_compiler(), llm.get_tokenizer()
    vocab = llm.engine.runner.model_config.vocab_size
    bounded = StructuredOutputsParams(json=BOUNDED)
    compiled, token_filter = compiler.compile(bounded), compiler.token_filter(bounded)
    assert token_filter is not None  # so the filter's AND is in the rows compared
    text = tokenizer.encode('{"word": "abc", "tags": ["x", "yz"]}', add_special_tokens=False)
    choice = compiler.compile(StructuredOutputsParams(choice=["ab"]))
    ended = GrammarState(choice)
    for t in tokenizer.encode("ab", add_special_tokens=False) + [min(llm.engine.eos_token_ids)]:
        assert ended.accept(t)
    assert ended.is_terminated
    engine = engine_stand_in(vocab)
    g = torch.Generator().manual_seed(0)
    for step, rows in enumerate([12, 3, 20, 12, 1, 2, 9, 9]):
        requests = []
        for i in range(rows):
            kind = (i + step) % 5
            if kind == 0:
                requests.append(request_stand_in(engine, None))
            elif kind == 1:
                requests.append(request_stand_in(engine, ended))
            else:
                state = GrammarState(compiled, token_filter)
                for t in text[: (i * 3 + step) % len(text)]:
                    assert state.accept(t)
                requests.append(request_stand_in(engine, state, finished=kind == 4 and i % 2 == 0))
        bitmask = engine.bitmask(requests)
        for row, r in enumerate(requests):
            live = r.grammar if r.grammar is not None and not r.seq.is_finished else None
            if bitmask is None:  # (no live grammar in the step: no mask)
                assert (alone(live, vocab) == -1).all()
            else:
                assert torch.equal(bitmask[row], alone(live, vocab)), (step, row)
        for buffer in engine.bitmask_buffers.buffers:  # stale contents for the next step to overwrite
            if buffer is not None:
                buffer.copy_(torch.randint(-2**31, 2**31, buffer.shape, generator=g, dtype=torch.int64).to(torch.int32))
    # Three steps in a row never share a buffer (one may still be uploading while the next is filled).
    takes = [engine.bitmask_buffers.take(4).data_ptr() for _ in range(4)]
    assert len(set(takes[:3])) == 3 and takes[3] == takes[0]


def test_a_step_whose_grammars_have_all_ended_needs_no_mask(llm):
    """No mask at all (the sampler's fast path) when no row's grammar has anything to say:
    rows without one, rows whose request has finished, rows whose grammar took its stop token."""
    tokenizer = llm.get_tokenizer()
    compiled = llm.engine.grammar_compiler().compile(StructuredOutputsParams(choice=["ab"]))
    ended, live = GrammarState(compiled), GrammarState(compiled)
    for t in tokenizer.encode("ab", add_special_tokens=False) + [min(llm.engine.eos_token_ids)]:
        assert ended.accept(t)
    engine = engine_stand_in(llm.engine.runner.model_config.vocab_size)
    dead = [request_stand_in(engine, None), request_stand_in(engine, ended),
            request_stand_in(engine, live, finished=True)]
    assert engine.bitmask(dead) is None
    assert engine.bitmask(dead + [request_stand_in(engine, live)]) is not None


def test_a_grammar_knows_it_has_ended_without_asking_each_step(llm):
    """GrammarState keeps is_terminated itself (asking xgrammar only when a stop token is
    taken): it must agree with the matcher after every token, one by one and in a batch,
    refused tokens and a stop token the grammar does not yet allow included."""
    from minivllm.structured import matcher

    tokenizer, eos = llm.get_tokenizer(), min(llm.engine.eos_token_ids)
    compiled = llm.engine.grammar_compiler().compile(StructuredOutputsParams(choice=["ab", "abc"]))
    walk = [eos] + tokenizer.encode("ab", add_special_tokens=False) + [999, eos, eos]
    single = [GrammarState(compiled) for _ in range(matcher.BATCH_FILL_ROWS)]
    batched = [GrammarState(compiled) for _ in range(matcher.BATCH_FILL_ROWS)]
    for token in walk:
        for state in single:
            state.accept(token)
        matcher.accept_tokens(batched, [token] * len(batched))
        for state in single + batched:
            assert state.is_terminated == state.matcher.is_terminated()
    assert all(state.is_terminated for state in single + batched)


@pytest.mark.parametrize("spec", [
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "string"}},
                                      "c": {"enum": ["x\ny", "z"]}}, "required": ["a", "b", "c"]},
    {"type": "object", "additionalProperties": {"type": "string"}},
    "json_object",
])
@pytest.mark.parametrize("compact", [True, False])
def test_json_without_bounded_strings_needs_no_token_filter(llm, spec, compact):
    """The JSON token filter is left out where xgrammar's grammar already refuses every token
    that spells a control character (its plain strings, whitespace, enums, property names):
    random walks through the grammar never find such a token allowed."""
    compiler = llm.engine.grammar_compiler()
    vocab = llm.engine.runner.model_config.vocab_size
    params = (StructuredOutputsParams(json_object=True, disable_any_whitespace=compact) if spec == "json_object"
              else StructuredOutputsParams(json=spec, disable_any_whitespace=compact))
    assert compiler.token_filter(params) is None
    banned = ~unpack_bitmask(compiler.token_filter(StructuredOutputsParams(
        json=BOUNDED, disable_any_whitespace=compact)).unsqueeze(0), vocab)[0]
    compiled = compiler.compile(params)
    g = torch.Generator().manual_seed(0)
    steps = 0
    for _ in range(16):
        state = GrammarState(compiled)
        for _ in range(40):
            if state.is_terminated:
                break
            allowed = unpack_bitmask(fill_bitmask([state], vocab), vocab)[0]
            assert not (allowed & banned).any()
            choices = allowed.nonzero().flatten()
            assert state.accept(int(choices[torch.randint(len(choices), (1,), generator=g)]))
            steps += 1
    assert steps > 300


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engines_masks_give_what_fresh_masks_give(async_scheduling):
    """The engine's bitmask (buffers kept, no mask when no grammar is live, the token filter
    only where it is needed) against the plainest one: a fresh tensor each step, each row
    filled alone, every JSON row ANDed with the filter. Same tokens, greedy and sampled."""
    from minivllm.structured.compiler import FILTERED_KEYWORDS

    prompts, params = greedy_structured_workload()
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=p.structured_outputs)
               for s, p in enumerate(params[:12])]
    prompts = prompts + prompts[:12]

    def fresh_bitmask(self, requests):
        vocab = self.runner.model_config.vocab_size
        out = torch.full((len(requests), (vocab + 31) // 32), -1, dtype=torch.int32)
        for row, r in enumerate(requests):
            grammar = self.structured.grammars.get(r.seq.seq_id)
            if grammar is not None and not r.seq.is_finished and not grammar.matcher.is_terminated():
                grammar.matcher.fill_next_token_bitmask(out, row)
                so = r.seq.sampling_params.structured_outputs
                if so.kind in ("json", "json_object"):  # (the filter's rows whatever the schema)
                    out[row] &= self.grammar_compiler().token_filter(
                        StructuredOutputsParams(json={"maxLength": 1}, disable_any_whitespace=so.disable_any_whitespace))
        return out

    assert "maxLength" in FILTERED_KEYWORDS
    llm = LLM(async_scheduling=async_scheduling, **POOL)
    outs = llm.generate(prompts, params, use_tqdm=False)
    reference = LLM(async_scheduling=async_scheduling, **POOL)
    reference.engine.structured.bitmask = fresh_bitmask.__get__(reference.engine)
    expected = reference.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(expected)
    check_valid(outs[:18], params[:18])


@pytest.mark.gpu
def test_a_pinned_bitmask_buffer_is_not_rewritten_before_its_upload():
    """On a GPU the bitmask's upload is queued without waiting: the buffer it reads must not
    be handed out again before the copy has run, even with the device far behind (a long
    sleep queued first)."""
    from minivllm.structured.matcher import BitmaskBuffers

    buffers = BitmaskBuffers(151936, pinned=True)
    first = buffers.take(256)
    assert first.is_pinned()
    first.fill_(7)
    torch.cuda._sleep(2_000_000_000)  # about a second of device time before the copy
    on_device = first.to("cuda", non_blocking=True)
    for _ in range(3):  # the third take is `first` again: it must wait for the copy
        again = buffers.take(256)
    assert again.data_ptr() == first.data_ptr()
    again.fill_(-1)
    torch.cuda.synchronize()
    assert (on_device == 7).all()
