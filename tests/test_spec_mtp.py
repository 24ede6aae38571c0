"""MTP speculation (chapter 19): the target checkpoint's multi-token-prediction head drafts.

Its drafts are checked against a reference written from the architecture (transformers
has no MTP forward: see ``minivllm.spec_decode.mtp``): the target's hidden states from
transformers, the head's two norms, concatenation and ``fc`` in plain torch, and its decoder
layer and final norm as transformers' own text model of one full-attention layer, every
draft recomputed from scratch. With MTP speculation on, greedy output must be the output
without, token for token (chunked prefill, preemption, every acceptance length), and a
checkpoint without the head must be refused naming what is missing.

A random head seldom guesses what a random target says, so where acceptance matters the
drafts the target verifies come from the oracle of tests/shared.py, while the head still
proposes at every step (and takes in every step the target ran): its own drafts are
recorded and compared with the reference.
"""
import functools
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.safetensors_index import safetensors_files
from minivllm.spec_decode import SpeculativeConfig
from minivllm.testing import make_tiny_checkpoint
from shared import OracleProposer, same_outputs

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = {"method": "mtp", "num_speculative_tokens": 3}
SEEDS = {"qwen3_5": 3, "qwen3_5_moe": 4, "qwen3_next": 8}  # conftest's HYBRID_SEEDS: the same decoder weights
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINES = {
    "roomy": dict(num_kv_blocks=256, block_size=8),
    # chunked prefill (the head takes in a prompt over several steps), preemption
    "tight": dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=24, max_num_seqs=6),
}


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """``mtp_checkpoint(family)``: the tiny hybrid checkpoint of conftest's ``hybrid_checkpoint``
    with an MTP head added."""

    @functools.cache
    def make(family: str, **kwargs):
        return make_tiny_checkpoint(tmp_path_factory.mktemp(f"{family}-mtp"), family=family, seed=SEEDS[family],
                                    mtp=True, **kwargs)

    return make


def workload(seed: int, n: int = 8):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 32), ignore_eos=True,
                             logprobs=2 if i % 3 == 0 else None) for i in range(n)]
    return prompts, params


def assert_all_given_back(llm, mtp) -> None:
    manager = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks
    assert mtp.states == {} and sorted(mtp.free_blocks) == list(range(mtp.num_blocks))


# -- the reference -----------------------------------------------------------------------------

class MTPReference:
    """The head's drafts for a sequence, computed from scratch: ``drafts(tokens, k)``."""

    def __init__(self, checkpoint, folder, device="cpu"):
        self.device = device
        self.hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
        config = json.loads((checkpoint / "config.json").read_text())
        tensors = {name: t for file in safetensors_files(checkpoint) for name, t in load_file(file).items()
                   if name.startswith("mtp.")}
        self.eps = config["rms_norm_eps"]
        self.fc = tensors["mtp.fc.weight"].float().to(device)
        self.norm_embedding = tensors["mtp.pre_fc_norm_embedding.weight"].float().to(device)
        self.norm_hidden = tensors["mtp.pre_fc_norm_hidden.weight"].float().to(device)
        # The decoder layer and the final norm: transformers' text model of one full-attention
        # layer holding the head's (loaded by transformers, experts and all), the embedding
        # beside it unused (the inputs are given as embeddings). The head is not one of the
        # decoder's layers, so none of them is dense by mlp_only_layers.
        config.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        weights = {"model." + name[len("mtp."):]: t for name, t in tensors.items()
                   if name.startswith("mtp.layers.0.") or name == "mtp.norm.weight"}
        weights["model.embed_tokens.weight"] = self.hf.get_input_embeddings().weight.detach().cpu().contiguous()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        self.layer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model.to(device).eval()

    def norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + weight)

    def head_input(self, embeds, hidden):
        """fc([norm(embedding of the next token) | norm(hidden state)])."""
        return torch.cat([self.norm(embeds, self.norm_embedding), self.norm(hidden, self.norm_hidden)], -1) @ self.fc.T

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """Draft 1 from the target's hidden states at positions 0..N - 2 (the last one the
        target computed) and the tokens 1..N - 1 after them; each further draft from the
        head's own output at the last position and the draft before. Returns the drafts and
        the logits each was the argmax of."""
        ids = torch.tensor(tokens, device=self.device)
        hidden = self.hf.model(input_ids=ids[None, :-1]).last_hidden_state[0]
        embed = self.hf.get_input_embeddings()
        x = self.head_input(embed(ids[1:]), hidden)
        out, logits = [], []
        for _ in range(k):
            positions = torch.arange(x.shape[0], device=self.device)[None]
            g = self.layer(inputs_embeds=x[None], position_ids=positions).last_hidden_state[0, -1]
            scores = self.hf.lm_head(g)
            token = int(scores.argmax())
            out.append(token)
            logits.append(scores)
            x = torch.cat([x, self.head_input(embed(torch.tensor([token], device=self.device)), g[None])])
        return out, logits


def check_drafts(reference: MTPReference, proposals, tol: float = 1e-4) -> int:
    """Each proposal's drafts must be the reference's; where one is not, the reference must
    see a near-tie there (its logit within ``tol`` of the best; the rest of that proposal
    follows another token, so is not compared). Returns how many such ties there were."""
    ties = 0
    for tokens, drafts in proposals:
        want, logits = reference.drafts(tokens, len(drafts))
        for got, w, scores in zip(drafts, want, logits):
            if got != w:
                assert scores[got] >= scores.max() - tol, (tokens, drafts, want)
                ties += 1
                break
    return ties


class Recorder:
    """The engine's MTP proposer, asked at every step as the engine would ask it, its
    drafts recorded with the sequence's tokens; the oracle's drafts go to the target."""

    def __init__(self, mtp, oracle: OracleProposer):
        self.mtp, self.oracle, self.proposals = mtp, oracle, []
        self.block_bytes = mtp.block_bytes

    def forget(self, seq) -> None:
        self.mtp.forget(seq)

    def propose(self, seqs, ks):
        for seq, drafts in zip(seqs, self.mtp.propose(seqs, ks)):
            if drafts:
                self.proposals.append((list(seq.token_ids), drafts))
        return self.oracle.propose(seqs, ks)


# -- configuration and refusals ------------------------------------------------------------------

def test_speculative_config_for_mtp():
    config = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2})
    assert config.method == "mtp" and config.model is None and config.num_speculative_tokens == 2
    cases = [
        ({"method": "mtp", "num_speculative_tokens": 2, "model": "/somewhere"}, 'method "mtp" takes none'),
        ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, 'for method "ngram" only'),
        ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an int >= 1"),
        ({"method": "mtp"}, "needs num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 2, "num_nextn_predict_layers": 1}, "unknown key"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "implemented: ngram, draft_model, mtp"),
    ]
    for d, message in cases:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(d)


def test_checkpoints_without_a_head_are_refused(hybrid_checkpoint, mtp_checkpoint, tiny_qwen3, tmp_path):
    # The same hybrid model without mtp.* tensors: every one of them is named.
    with pytest.raises(ValueError, match=r'method "mtp" .*incomplete or absent: checkpoint .* is missing tensors '
                                         r"for: mtp\.fc\.weight, mtp\.layers\.0\.input_layernorm\.weight, .*"
                                         r"mtp\.pre_fc_norm_hidden\.weight$"):
        LLM(str(hybrid_checkpoint("qwen3_5")), num_kv_blocks=16, speculative_config=MTP)
    # One tensor of the head missing.
    partial = tmp_path / "partial"
    shutil.copytree(mtp_checkpoint("qwen3_5"), partial)
    tensors = load_file(partial / "model.safetensors")
    del tensors["mtp.norm.weight"]
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"is missing tensors for: mtp\.norm\.weight$"):
        LLM(str(partial), num_kv_blocks=16, speculative_config=MTP)
    # A config that says there is no head; a family that has none.
    none = tmp_path / "none"
    shutil.copytree(mtp_checkpoint("qwen3_5"), none)
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 0}))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers=0; the checkpoint has no MTP head"):
        LLM(str(none), num_kv_blocks=16, speculative_config=MTP)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no multi-token-prediction head"):
        LLM(str(tiny_qwen3), num_kv_blocks=16, speculative_config=MTP)


def test_the_target_ignores_the_head(hybrid_checkpoint, mtp_checkpoint):
    """Loading the target skips ``mtp.*`` (in a text checkpoint as in a vision-language one):
    with the head added, the model's output is the same as without."""
    prompts, params = workload(seed=0, n=3)
    without = LLM(str(hybrid_checkpoint("qwen3_5")), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    with_head = LLM(str(mtp_checkpoint("qwen3_5")), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    same_outputs(without, with_head)


# -- the drafts, and the engine ---------------------------------------------------------------

def run_with_recorder(checkpoint, prompts, params, k, engine_args):
    plain = LLM(str(checkpoint), dtype="float32", device=DEVICE, **engine_args)
    want = plain.generate(prompts, params, use_tqdm=False)
    del plain
    spec = LLM(str(checkpoint), dtype="float32", device=DEVICE, **engine_args,
               speculative_config=dict(MTP, num_speculative_tokens=k))
    mtp = spec.engine.proposer
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)}
    oracle = OracleProposer(reference, spec.engine.runner.model_config.vocab_size, seed=k)
    recorder = spec.engine.proposer = Recorder(mtp, oracle)
    got = spec.generate(prompts, params, use_tqdm=False)
    return want, got, spec, recorder


@pytest.mark.parametrize("family,engine", [("qwen3_5", "roomy"), ("qwen3_5", "tight"), ("qwen3_5_moe", "tight"),
                                           ("qwen3_next", "roomy")])
def test_drafts_equal_the_reference(mtp_checkpoint, tmp_path, family, engine):
    """Every acceptance length, chunked prefill and preemption: the head's drafts at every
    proposal are the reference's, and the output is the output without speculation."""
    checkpoint = mtp_checkpoint(family)
    prompts, params = workload(seed=2)
    want, got, spec, recorder = run_with_recorder(checkpoint, prompts, params, 3, ENGINES[engine] | {
        "record_trace": True})
    # Logprobs to float32 rounding, relative: a verifying step computes a sequence's rows in
    # other matmul shapes than a decode step, and on some CPUs a logprob near -10 then
    # differs in its sixth digit (1.05e-5 seen on an EPYC).
    same_outputs(want, got, rel=1e-5)
    assert set(recorder.oracle.lengths) == {0, 1, 2, 3}, dict(recorder.oracle.lengths)
    if engine == "tight":
        assert any(r.preempted for r in spec.engine.trace), "the tight pool never preempted"
    proposals = recorder.proposals
    assert len(proposals) > 20 and any(len(d) == 3 for _, d in proposals)
    proposals = random.Random(0).sample(proposals, min(40, len(proposals)))
    ties = check_drafts(MTPReference(checkpoint, tmp_path / "reference"), proposals)
    assert ties <= len(proposals) // 10
    assert_all_given_back(spec, recorder.mtp)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_with_mtp(mtp_checkpoint, engine, k):
    """The head drafting for the target itself, as a user runs it."""
    checkpoint = mtp_checkpoint("qwen3_5")
    prompts, params = workload(seed=k)
    want = LLM(str(checkpoint), **ENGINES[engine]).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(checkpoint), **ENGINES[engine], speculative_config=dict(MTP, num_speculative_tokens=k))
    same_outputs(want, spec.generate(prompts, params, use_tqdm=False))
    stats = spec.engine.stats
    assert stats["spec_draft_tokens"] > 0 and stats["spec_verify_steps"] > 0
    assert_all_given_back(spec, spec.engine.proposer)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_greedy_identical_with_mtp_moe(mtp_checkpoint, family):
    """The MoE families' heads route their layer through experts, as their decoders do."""
    checkpoint = mtp_checkpoint(family)
    from minivllm.layers.moe import SparseMoeBlock

    prompts, params = workload(seed=5, n=4)
    want = LLM(str(checkpoint), num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(checkpoint), num_kv_blocks=128, speculative_config=MTP)
    assert isinstance(spec.engine.proposer.head.layers[0].mlp, SparseMoeBlock)
    same_outputs(want, spec.generate(prompts, params, use_tqdm=False))
    assert spec.engine.stats["spec_draft_tokens"] > 0


def test_vision_language_checkpoint(mtp_checkpoint):
    """As the hub publishes Qwen3.5: the text model under model.language_model., the head
    at the top level (mtp.*)."""
    checkpoint = mtp_checkpoint("qwen3_5", vision_language=True)
    prompts, params = workload(seed=6, n=3)
    want = LLM(str(checkpoint), num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(checkpoint), num_kv_blocks=128, speculative_config=MTP)
    same_outputs(want, spec.generate(prompts, params, use_tqdm=False))
    assert spec.engine.stats["spec_draft_tokens"] > 0


def test_seeded_sampling_is_reproducible(mtp_checkpoint):
    """Sampled requests speculate too (greedy drafts, point masses: the acceptance rule
    keeps the target's distribution); a seed gives the same completion every run."""
    checkpoint = mtp_checkpoint("qwen3_5")
    prompts = workload(seed=7, n=3)[0]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=11)
    runs = [[o.outputs[0].token_ids for o in LLM(str(checkpoint), num_kv_blocks=128, speculative_config=MTP)
             .generate(prompts, params, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 20 for t in runs[0])


# -- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_drafts_equal_the_reference_on_gpu(tmp_path):
    """On a GPU, float32: the target's decode steps replay CUDA graphs and its verifying
    steps run the Triton kernels eagerly; the head runs on the Triton attention kernels over
    its own pool. Greedy output is the output without speculation, the head's drafts are
    the reference's (on the GPU too)."""
    path = make_tiny_checkpoint(tmp_path / "ckpt", family="qwen3_5", seed=6, mtp=True, hidden_size=256,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=32, linear_key_head_dim=64,
                                linear_value_head_dim=64)
    prompts, params = workload(seed=8, n=24)
    want, got, spec, recorder = run_with_recorder(path, prompts, params, 4,
                                                  dict(gpu_memory_utilization=0.3, async_scheduling=False))
    same_outputs(want, got, logprob_tol=1e-3)
    assert spec.engine.runner.graphs, "decode steps did not run on CUDA graphs"
    assert set(recorder.oracle.lengths) == set(range(5))
    proposals = random.Random(0).sample(recorder.proposals, min(40, len(recorder.proposals)))
    ties = check_drafts(MTPReference(path, tmp_path / "reference", device="cuda"), proposals, tol=1e-3)
    assert ties <= len(proposals) // 10
    assert_all_given_back(spec, recorder.mtp)
