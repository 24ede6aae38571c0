"""Offline inference: plain and streaming generation with minivllm's vLLM-shaped API.

With no arguments it runs the small model bundled with the package, so it works on a
laptop CPU with no download:

    python examples/offline_inference.py
    python examples/offline_inference.py --model path/to/hf-checkpoint --max-tokens 64
"""
import argparse

from minivllm import LLM, SamplingParams

PROMPTS = [
    "It is a truth universally acknowledged,",
    "To be, or not to be:",
    "The lady said to her sister",
    "Enter the king, with his lords.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder or hub id (default: the bundled model)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    llm = LLM(model=args.model, seed=args.seed)  # the seed makes the sampled text repeatable

    # 1. A batch: all prompts are scheduled together; outputs come back in prompt order.
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
    for output in llm.generate(PROMPTS, params):
        completion = output.outputs[0]
        print(f"\n{output.prompt!r}\n  -> {completion.text!r}  ({len(completion.token_ids)} tokens, "
              f"{completion.finish_reason})")

    # 2. Streaming: text arrives piece by piece as tokens are sampled.
    prompt = PROMPTS[0]
    print(f"\nstreaming {prompt!r} (greedy):\n  ", end="")
    for delta in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens)):
        print(delta, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
