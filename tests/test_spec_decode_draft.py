"""Draft-model speculation (chapter 19): a small model drafts, the target verifies. With it
on, greedy requests must give token for token what they give with it off (on the bundled
model, and on a tiny one through chunked prefill and preemption), seeded sampled ones must
be reproducible, the draft's own cache must stay exactly what a fresh prefill would give
(after rejections too), and be given back when a sequence finishes, is aborted or is
preempted. The drafts come from layer-skip models (the target's first layers), which agree
with the target often but not always, so both acceptance and rejection are exercised."""
import json
import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.cuda_graphs import DECODE, VERIFY
from minivllm.engine.sequence import Sequence
from minivllm.llm import BUNDLED_MODEL
from minivllm.spec_decode import SpeculativeConfig
from minivllm.spec_decode.draft import BUNDLED_DRAFT, DraftModelProposer, DraftState
from minivllm.testing import make_layer_skip_draft, make_tiny_checkpoint
from shared import same_outputs

pytestmark = pytest.mark.usefixtures("one_thread")

# Openings from the corpus the bundled model (and its draft) learnt from.
PASSAGES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to unite "
    "some of the best blessings of existence; and had lived nearly twenty-one years in the world with very "
    "little to distress or vex her.",
    "The family of Dashwood had long been settled in Sussex. Their estate was large, and their residence was at "
    "Norland Park, in the centre of their property, where, for many generations, they had lived in so "
    "respectable a manner as to",
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings and arrows "
    "of outrageous fortune, Or to take arms against a sea of troubles, And by opposing end them.",
]


@pytest.fixture(scope="module")
def bundled_draft(tmp_path_factory):
    """A draft of the bundled model: its first 3 of 6 layers (accepts about a fifth of its drafts)."""
    return make_layer_skip_draft(BUNDLED_MODEL, tmp_path_factory.mktemp("bundled-draft"), num_layers=3)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), family="qwen3", seed=11, with_tokenizer=True,
                                num_hidden_layers=3)


@pytest.fixture(scope="module")
def tiny_draft(tiny_target, tmp_path_factory):
    return make_layer_skip_draft(tiny_target, tmp_path_factory.mktemp("tiny-draft"), num_layers=2, noise=0.3)


def draft(model, k=3) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


def same(a, b, logprob_tol=1e-5) -> None:
    # (float32: a verifying chunk and a decode step sum in other orders; rel for the unlikely tokens)
    same_outputs(a, b, logprob_tol, rel=1e-5)


def stats(llm) -> dict:
    return llm.engine.stats


def assert_all_given_back(llm) -> None:
    """No request left, and every block of both pools free."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    proposer = engine.proposer
    assert proposer.states == {}
    assert proposer.num_free_blocks == proposer.num_blocks
    assert sorted(proposer.free_blocks) == list(range(proposer.num_blocks))  # each once


def passages(n: int) -> list[str]:
    return PASSAGES[:n]


# -- configuration -----------------------------------------------------------------------

def test_method_is_inferred_from_a_model(bundled_draft):
    inferred = SpeculativeConfig.from_dict(draft(bundled_draft))
    explicit = SpeculativeConfig.from_dict({"method": "draft_model", **draft(bundled_draft)})
    assert inferred == explicit and inferred.method == "draft_model" and inferred.model == str(bundled_draft)


def test_config_errors(bundled_draft, tiny_draft, tmp_path, hybrid_checkpoint, tiny_target):
    cases = [
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs a "model"'),
        ({"num_speculative_tokens": 2}, 'needs a "method"'),
        ({"model": str(tmp_path / "nowhere"), "num_speculative_tokens": 2}, "is not a checkpoint folder"),
        ({"model": 3, "num_speculative_tokens": 2}, "must be a folder path"),
        ({"model": str(bundled_draft)}, "needs num_speculative_tokens"),
        ({"model": str(bundled_draft), "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an int >= 1"),
        ({"model": str(bundled_draft), "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
        ({"model": str(bundled_draft), "num_speculative_tokens": 2, "prompt_lookup_max": 3}, 'for method "ngram" only'),
        ({"method": "ngram", "model": str(bundled_draft), "num_speculative_tokens": 2}, 'method "ngram" takes none'),
        ({"method": "eagle", "model": str(bundled_draft), "num_speculative_tokens": 2}, "not implemented yet"),
    ]
    for d, message in cases:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(d)
    # The draft must share the target's vocabulary (the tiny draft has 512 tokens, the bundled model 8192).
    with pytest.raises(ValueError, match=r"speculative_config model=.* has a vocabulary of 512 tokens, the target "
                                         r"model 8192"):
        LLM(num_kv_blocks=16, speculative_config=draft(tiny_draft))
    with pytest.raises(ValueError, match="is a hybrid model"):
        LLM(str(tiny_target), num_kv_blocks=16, speculative_config=draft(hybrid_checkpoint("qwen3_5")))


def test_cli_flag_takes_a_draft_model(bundled_draft):
    import argparse

    from minivllm.cli import add_engine_args, engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flag = json.dumps(draft(bundled_draft, k=4))
    args = engine_args(parser.parse_args(["--speculative-config", flag]))
    llm = LLM(num_kv_blocks=32, **args)
    assert llm.engine.speculative.method == "draft_model" and llm.engine.speculative.num_speculative_tokens == 4
    [out] = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8 and out.spec_decode is not None


def test_serve_with_a_draft_model(bundled_draft):
    """``minivllm serve --speculative-config '{"model": ...}'``, the engine core in a process
    of its own: the completion is the offline one, and /metrics counts the drafts."""
    import httpx

    from minivllm.testing import ServeProcess

    prompt = passages(1)[0]
    [want] = LLM(num_kv_blocks=256).generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    flag = json.dumps(draft(bundled_draft))
    with ServeProcess(["--engine-process", "--num-kv-blocks", "256", "--speculative-config", flag],
                      env={"OMP_NUM_THREADS": "1"}) as server:
        body = {"model": "bundled", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        page = httpx.get(server.url + "/metrics", timeout=10).text
    assert got["choices"][0]["text"] == want.outputs[0].text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
              if line.startswith("vllm:spec_decode_num_")}
    assert values["vllm:spec_decode_num_draft_tokens_total"] > values["vllm:spec_decode_num_accepted_tokens_total"] > 0


def test_the_kv_budget_pays_for_the_draft_cache(bundled_draft):
    """On the CPU the pool is cpu_kv_cache_space: with a draft, its blocks share it."""
    plain = LLM(cpu_kv_cache_space=0.01)
    spec = LLM(cpu_kv_cache_space=0.01, speculative_config=draft(bundled_draft))
    runner, proposer = spec.engine.runner, spec.engine.proposer
    assert proposer.num_blocks == runner.num_kv_blocks < plain.engine.runner.num_kv_blocks
    assert runner.num_kv_blocks * (runner.block_bytes + proposer.block_bytes) <= 0.01 * 2**30
    assert proposer.kv.numel() * proposer.kv.element_size() == proposer.num_blocks * proposer.block_bytes


# -- the draft's cache -------------------------------------------------------------------

def test_incremental_drafts_match_a_fresh_prefill(tiny_draft):
    """Sequences grow as under speculation (each step keeps some of the drafts, then one
    token of its own); after every step the proposer, which catches up from its cache and
    cuts it back after a rejection, must draft what a proposer that prefills the whole
    sequence from scratch drafts."""
    from minivllm.config import EngineConfig

    spec = SpeculativeConfig.from_dict(draft(tiny_draft))
    # (The incremental one catches up in passes of at most 8 tokens: a new sequence takes several.)
    incremental = DraftModelProposer(spec, EngineConfig(model=str(tiny_draft), block_size=4, max_num_batched_tokens=8))
    fresh = DraftModelProposer(spec, EngineConfig(model=str(tiny_draft), block_size=4))
    incremental.allocate(200)
    fresh.allocate(200)
    rng = random.Random(0)
    seqs = [Sequence([rng.randrange(3, 512) for _ in range(rng.randint(1, 20))], SamplingParams()) for _ in range(5)]
    kept_some = cut_back = 0
    for _ in range(12):
        ks = [rng.randint(1, 5) for _ in seqs]
        got = incremental.propose(seqs, ks)
        for seq in seqs:
            fresh.forget(seq)
        assert got == fresh.propose(seqs, ks)
        assert all(len(d) == k for d, k in zip(got, ks))
        for seq, drafts in zip(seqs, got):  # keep a random share of the drafts, then a token of "the target's"
            a = rng.randint(0, len(drafts))
            kept_some += a > 0
            cut_back += a < len(drafts) - 1  # a fed draft was rejected: the cache is cut back
            # Now and then a few tokens more, as if steps had passed without proposals: then
            # only comparing the fed drafts with the tokens finds where the cache goes stale.
            extra = rng.choice([1, 1, 2, 4])
            seq.token_ids += drafts[:a] + [rng.randrange(3, 512) for _ in range(extra)]
    assert kept_some and cut_back
    for seq in seqs:
        incremental.forget(seq)
    assert incremental.states == {} and incremental.num_free_blocks == 200


def test_drafts_through_the_triton_kernels(tiny_draft, monkeypatch):
    """On a GPU the draft's passes run the paged Triton attention kernels (here in Triton's
    interpreter) on the metadata the proposer builds: they must draft what the torch
    reference drafts, through chunked catch-ups, one-token passes and cut-backs."""
    import minivllm.ops.attention as attention
    from minivllm.config import EngineConfig

    spec = SpeculativeConfig.from_dict(draft(tiny_draft))
    config = EngineConfig(model=str(tiny_draft), block_size=4, max_num_batched_tokens=16)
    reference, kernels = DraftModelProposer(spec, config), DraftModelProposer(spec, config)
    reference.allocate(100)
    kernels.allocate(100)
    rng = random.Random(1)
    seqs = [Sequence([rng.randrange(3, 512) for _ in range(rng.randint(1, 20))], SamplingParams()) for _ in range(4)]
    for _ in range(4):
        ks = [rng.randint(1, 4) for _ in seqs]
        want = reference.propose(seqs, ks)
        with monkeypatch.context() as m:
            m.setattr(attention, "use_triton", lambda x: True)
            assert kernels.propose(seqs, ks) == want
        for seq, drafts in zip(seqs, want):
            seq.token_ids += drafts[: rng.randint(0, len(drafts))] + [rng.randrange(3, 512)]


def test_the_target_as_its_own_draft_is_always_right():
    """With the target as its own draft, a greedy draft is the target's own next token: every
    one must be accepted, which holds only if the draft's passes (catch-up chunks, then one
    token at a time, at the right positions over its own cache) compute what the target does.
    (Float32; a near tie could in principle round apart, hence not quite 1.)"""
    spec = LLM(num_kv_blocks=256, speculative_config=draft(BUNDLED_MODEL, 4))
    spec.generate(passages(3) + ["Once upon a time"], SamplingParams(temperature=0, max_tokens=40,
                                                                           ignore_eos=True), use_tqdm=False)
    s = stats(spec)
    assert s["spec_draft_tokens"] > 100
    assert s["spec_accepted_tokens"] / s["spec_draft_tokens"] > 0.97
    assert_all_given_back(spec)


def test_resume_at():
    state = DraftState(num_cached=3, fed_drafts=[7, 8])
    assert state.resume_at([1, 2, 3, 7, 8, 9]) == 5  # both fed drafts kept
    assert state.resume_at([1, 2, 3, 7, 5]) == 4  # the second rejected
    assert state.resume_at([1, 2, 3, 6]) == 3  # the first rejected
    assert state.resume_at([1, 2, 3, 6, 8, 9]) == 3  # the first rejected, more tokens since
    assert state.resume_at([1, 2, 3, 7]) == 3  # one token at least is fed again


def test_a_full_pool_means_no_drafts_not_an_error(tiny_target, tiny_draft):
    """Draft blocks that do not fit: that sequence gets no drafts, and the output is the same."""
    plain = LLM(str(tiny_target), num_kv_blocks=64, block_size=4)
    spec = LLM(str(tiny_target), num_kv_blocks=64, block_size=4, speculative_config=draft(tiny_draft))
    spec.engine.proposer.allocate(12)  # a pool far smaller than the target's
    prompts = [[5 + i, 6, 7, 8, 9] * 3 for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    same(plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False))
    assert 0 < stats(spec)["spec_verify_steps"]
    assert stats(spec)["spec_verify_steps"] < 4 * 19  # some steps had no room to draft
    assert_all_given_back(spec)


# -- the engine: the same outputs --------------------------------------------------------

@pytest.mark.parametrize("k", [1, 4])
def test_bundled_model_greedy_identical(bundled_draft, k):
    plain = LLM(num_kv_blocks=256)
    spec = LLM(num_kv_blocks=256, record_trace=True, speculative_config=draft(bundled_draft, k))
    prompts = passages(3) + ["Once upon a time", "To be, or not to be"]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    same(want, got)
    s = stats(spec)
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"], "drafts must be both accepted and rejected"
    assert any(kind == "decode" and n > 1 for r in spec.engine.trace for _, n, kind in r.seqs)
    assert_all_given_back(spec)


def tiny_workload(seed: int, n: int = 16):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=30, logprobs=3))
        elif kind == 2:
            params.append(SamplingParams(temperature=0, max_tokens=35, min_tokens=10, stop_token_ids=[7, 8, 9]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=None))  # until EOS or the context's end
    return prompts, params


def test_greedy_identical_with_chunking_and_preemption(tiny_target, tiny_draft):
    """A tight pool: chunked prefills and preemptions. Step by step, the draft holds state
    for running sequences only (a preempted one's went back at once), and every draft
    block is either free or in exactly one sequence's table."""
    args = dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    plain = LLM(str(tiny_target), **args)
    spec = LLM(str(tiny_target), record_trace=True, speculative_config=draft(tiny_draft, 3), **args)
    prompts, params = tiny_workload(1)
    want = plain.generate(prompts, params, use_tqdm=False)
    engine, proposer = spec.engine, spec.engine.proposer
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        running = {seq.seq_id for seq in engine.scheduler.running}
        assert set(proposer.states) <= running
        held = [b for state in proposer.states.values() for b in state.block_table]
        assert len(held) == len(set(held)) and len(held) + proposer.num_free_blocks == proposer.num_blocks
    same(want, [outputs[i] for i in ids])
    assert any(r.preempted for r in engine.trace), "the tight pool never preempted"
    s = stats(spec)
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    assert_all_given_back(spec)


def test_max_tokens_and_stop_strings(bundled_draft):
    plain = LLM(num_kv_blocks=128)
    spec = LLM(num_kv_blocks=128, speculative_config=draft(bundled_draft, 5))
    prompt = passages(1)[0]
    for max_tokens in (1, 2, 3, 7, 12):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        got = spec.generate([prompt], params, use_tqdm=False)
        same(plain.generate([prompt], params, use_tqdm=False), got)
        assert len(got[0].outputs[0].token_ids) == max_tokens
    [full] = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    text = full.outputs[0].text
    for params in (SamplingParams(temperature=0, max_tokens=40, stop=[text[20:24]]),
                   SamplingParams(temperature=0, max_tokens=40, stop=[text[30:33]], include_stop_str_in_output=True)):
        want = plain.generate([prompt], params, use_tqdm=False)
        assert want[0].outputs[0].finish_reason == "stop"
        same(want, spec.generate([prompt], params, use_tqdm=False))
    assert stats(spec)["spec_accepted_tokens"] > 0
    assert_all_given_back(spec)


def test_abort_gives_the_draft_state_back(bundled_draft):
    llm = LLM(num_kv_blocks=128, speculative_config=draft(bundled_draft))
    engine, proposer = llm.engine, llm.engine.proposer
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    ids = [engine.add_request(llm.tokenizer.encode(p), params) for p in passages(3)]
    for _ in range(4):
        engine.step()
    seqs = {seq.request_id: seq for seq in engine.scheduler.running}
    assert len(proposer.states) == 3
    engine.abort_request(ids[1])
    assert seqs[ids[1]].seq_id not in proposer.states and len(proposer.states) == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_given_back(llm)


# -- sampled requests and metrics ----------------------------------------------------------

def test_seeded_sampling_reproducible(bundled_draft):
    spec = LLM(num_kv_blocks=256, speculative_config=draft(bundled_draft))
    prompts = passages(3)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    first = spec.generate(prompts, params, use_tqdm=False)
    again = spec.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]  # another batch order
    same(first, again)
    assert all(len(o.outputs[0].token_ids) == 30 for o in first)
    assert stats(spec)["spec_accepted_tokens"] > 0
    assert_all_given_back(spec)


def test_acceptance_metrics_add_up(bundled_draft):
    spec = LLM(num_kv_blocks=256, speculative_config=draft(bundled_draft, 3))
    outs = spec.generate(passages(4), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                         use_tqdm=False)
    s = stats(spec)
    metrics = [o.spec_decode for o in outs]
    assert all(m is not None for m in metrics)
    assert sum(m.num_draft_tokens for m in metrics) == s["spec_draft_tokens"]
    assert sum(m.num_accepted_tokens for m in metrics) == s["spec_accepted_tokens"]
    assert sum(m.num_steps for m in metrics) == s["spec_verify_steps"]
    for m, o in zip(metrics, outs):
        assert 0 <= m.acceptance_rate <= 1 and 1 <= m.mean_accepted_length <= 4
        # A verifying step emits its accepted drafts and one token: the first token came from the prompt's step.
        assert m.num_accepted_tokens + m.num_steps <= len(o.outputs[0].token_ids) - 1


# -- the draft trained for the bundled model --------------------------------------------

def test_shipped_draft():
    """The draft in minivllm/assets/draft: small, installed with the package, sharing the
    bundled model's tokenizer, and a trained one: with k = 1 (each draft the draft's guess at
    the target's next token) more than half accepted on text it was trained on, greedy. (A
    random draft of this vocabulary gets about one in a thousand; one trained for 8 minutes
    on two CPU cores, 33%; the shipped one, 68 s on an H200 (benchmarks/draft_model_training.json), 61%.)"""
    assert (BUNDLED_DRAFT / "config.json").is_file(), f"no draft model shipped in {BUNDLED_DRAFT}"
    size = sum(f.stat().st_size for f in BUNDLED_DRAFT.glob("*.safetensors"))
    assert size <= 5 * 2**20, f"the shipped draft's weights take {size} bytes: more than 5 MiB"
    pyproject = (BUNDLED_MODEL.parents[2] / "pyproject.toml").read_text()
    assert 'minivllm = ["assets/**/*"]' in pyproject  # package data: the draft is installed with the package
    spec = LLM(num_kv_blocks=256, speculative_config=draft(BUNDLED_DRAFT, 1))
    spec.generate(passages(4), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    s = stats(spec)
    print(f"acceptance {s['spec_accepted_tokens'] / s['spec_draft_tokens']:.3f}")
    assert s["spec_accepted_tokens"] / s["spec_draft_tokens"] > 0.5


# -- the GPU ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_greedy_identical_on_gpu(bundled_draft):
    """On a GPU the draft runs on the Triton attention kernels with its own pool, the
    target's decode steps replay CUDA graphs, its verifying steps verify graphs and the
    draft's proposals graphs of their own; the outputs must still be those of speculation
    off, token for token (in float32: in bfloat16 a verifying chunk and a decode step may
    round a near tie apart)."""
    prompts = PASSAGES * 2 + ["Once upon a time"] * 4
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, logprobs=1)
    plain = LLM(device="cuda", dtype="float32", async_scheduling=False, gpu_memory_utilization=0.3)
    want = plain.generate(prompts, params, use_tqdm=False)
    del plain
    spec = LLM(device="cuda", dtype="float32", gpu_memory_utilization=0.3, speculative_config=draft(bundled_draft, 4))
    same(want, spec.generate(prompts, params, use_tqdm=False), logprob_tol=1e-3)
    assert sum(spec.engine.runner.cudagraphs.replays_of(DECODE).values()) > 0
    assert sum(spec.engine.runner.cudagraphs.replays_of(VERIFY).values()) > 0
    assert sum(spec.engine.proposer.graphs.replays.values()) > 0  # the draft's whole proposals
    s = stats(spec)
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    assert spec.engine.proposer.kv.is_cuda
    assert_all_given_back(spec)
