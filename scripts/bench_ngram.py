"""N-gram speculation on the CPU: acceptance and tokens/s, with and without, on real text.

Two workloads from the corpus the bundled model was trained on, 8 prompts each, greedy:
``copy`` (a passage, then its first half again: the continuation can copy the rest, as a
summary or an edit copies its source) and ``continue`` (a passage, continued freely). Each
k is checked against speculation off token for token before its speed is reported.

    OMP_NUM_THREADS=1 python scripts/bench_ngram.py [--k 1 2 3 4 5] [--max-tokens 64]
"""
import argparse
import json
import time

from minivllm import LLM, SamplingParams

CORPUS = "/work/shared/corpus/austen.txt"


def prompts(kind: str, n: int, chars: int = 600) -> list[str]:
    text = open(CORPUS, encoding="utf-8").read()
    out = []
    for i in range(n):
        start = text.index(" ", 200_000 + i * 97_003) + 1
        passage = text[start : start + chars]
        out.append(passage + "\n\n" + passage[: chars // 2] if kind == "copy" else passage)
    return out


def run(llm: LLM, ps: list[str], params: SamplingParams) -> tuple[list, float]:
    start = time.perf_counter()
    outs = llm.generate(ps, params, use_tqdm=False)
    return outs, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for kind in ("copy", "continue"):
        ps = prompts(kind, args.num_prompts)
        plain = LLM()
        plain.generate(ps[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        base, seconds = run(plain, ps, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in base)
        rows.append({"workload": kind, "k": 0, "tokens_per_s": round(tokens / seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)
        for k in args.k:
            llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3})
            llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
            before = dict(llm.engine.stats)
            outs, seconds = run(llm, ps, params)
            assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base], k
            s = {key: llm.engine.stats[key] - before[key] for key in before}
            rows.append({"workload": kind, "k": k, "tokens_per_s": round(tokens / seconds, 1),
                         "acceptance_rate": round(s["spec_accepted_tokens"] / max(s["spec_draft_tokens"], 1), 3),
                         "mean_accepted_length": round(1 + s["spec_accepted_tokens"] / max(s["spec_verify_steps"], 1), 2)})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
