"""``minivllm generate | bench throughput | bench latency | bench kernels | bench moe | bench tp``."""
import argparse
import json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="a local folder or hub id (default: the bundled model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--seed", type=int, default=None)
    bench = sub.add_parser("bench", help="benchmarks on a CUDA GPU")
    bench.add_argument("which", choices=["throughput", "latency", "kernels", "moe", "tp"])
    bench.add_argument("--out", default="benchmarks")
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    args = parser.parse_args(argv)

    if args.command == "generate":
        from minivllm import LLM, SamplingParams

        llm = LLM(args.model)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        print(args.prompt, end="", flush=True)
        for delta in llm.stream(args.prompt, params):
            print(delta, end="", flush=True)
        print()
    elif args.command == "bench":
        if args.which == "throughput":
            from minivllm.bench.throughput import main as run

            report = run(args.out, with_transformers=not args.no_transformers)
        elif args.which == "moe":
            from minivllm.bench.moe import main as run

            report = run(args.out)
        elif args.which == "latency":
            from minivllm.bench.latency import main as run

            report = run(args.out)
        elif args.which == "tp":
            from minivllm.bench.tensor_parallel import main as run

            report = run(args.out)
        else:
            from minivllm.bench.kernels import main as run

            report = run(args.out)
        print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
