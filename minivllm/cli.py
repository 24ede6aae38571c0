"""``minivllm generate | chat | serve | bench``; every command defaults to the bundled model."""
import argparse
import json
import logging
import sys

MODEL_HELP = "a local folder or hub id (default: the bundled model)"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # as minivllm.server.api's (not imported: it needs fastapi)


def engine_args(args) -> dict:
    """The engine arguments a command line gave (None: the engine's default)."""
    names = ("dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization",
             "num_kv_blocks", "enforce_eager")
    given = {name: getattr(args, name, None) for name in names}
    return {k: v for k, v in given.items() if v not in (None, False)}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16 or float16")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def server_config(args):
    """The ServerConfig a ``serve`` command line gave."""
    from minivllm.server.api import ServerConfig

    config = ServerConfig(api_key=args.api_key)
    for name in ("max_request_bytes", "max_stop", "max_stop_chars", "max_stop_token_ids"):
        if getattr(args, name) is not None:
            setattr(config, name, getattr(args, name))
    if args.allowed_hosts is not None:
        config.allowed_hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    elif args.host not in LOOPBACK_HOSTS:
        config.allowed_hosts = ["*"]  # reached by whatever name the network gives it
    if args.allowed_origins is not None:
        config.allowed_origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--seed", type=int, default=None)

    chat = sub.add_parser("chat", help="talk to the model in the terminal (multi-turn, streaming)")
    chat.add_argument("--model", default=None, help=MODEL_HELP)
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--seed", type=int, default=None)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--model", default=None, help=MODEL_HELP)
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients ask for (default: --model as given, or 'bundled')")
    serve.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes and the docs")
    serve.add_argument("--max-request-bytes", type=int, default=None, help="refuse bigger bodies (default 16 MiB)")
    serve.add_argument("--max-stop", type=int, default=None, help="stop strings per request (default 64)")
    serve.add_argument("--max-stop-chars", type=int, default=None, help="characters per stop string (default 256)")
    serve.add_argument("--max-stop-token-ids", type=int, default=None, help="stop_token_ids per request (default 256)")
    serve.add_argument("--allowed-hosts", default=None,
                       help="comma-separated Host names to answer to; '*' for any (default: loopback names when "
                            "--host is loopback, else any)")
    serve.add_argument("--allowed-origins", default=None,
                       help="comma-separated origins whose web pages may call the API (CORS; default: none)")
    add_engine_args(serve)

    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, kernels, moe, gated-delta, tp: a CUDA GPU; serving: any)")
    bench.add_argument("which", choices=["throughput", "latency", "kernels", "moe", "gated-delta", "serving", "tp"])
    bench.add_argument("--out", default="benchmarks")
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--model", default=None, help="serving: the model (default: Qwen3-0.6B shapes on a GPU, "
                                                     "the bundled model on a CPU)")
    bench.add_argument("--rates", default=None, help="serving: request rates per second, comma-separated; inf = all at once")
    bench.add_argument("--num-requests", type=int, default=None, help="serving: requests per rate")
    args = parser.parse_args(argv)

    if args.command == "generate":
        from minivllm import LLM, SamplingParams

        llm = LLM(args.model)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        print(args.prompt, end="", flush=True)
        for delta in llm.stream(args.prompt, params):
            print(delta, end="", flush=True)
        print()
    elif args.command == "chat":
        run_chat(args)
    elif args.command == "serve":
        from minivllm.llm import LLM
        from minivllm.server.api import serve as run_server
        from minivllm.server.async_engine import AsyncLLMEngine

        config = server_config(args)
        if args.host not in LOOPBACK_HOSTS and args.api_key is None:
            print(f"warning: serving on {args.host} with no --api-key: anyone who can reach it can use it",
                  file=sys.stderr)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
        llm = LLM(args.model, **engine_args(args))
        name = args.served_model_name or (args.model or "bundled")
        sys.exit(run_server(AsyncLLMEngine(llm.engine), name, args.host, args.port, config))
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
        elif args.which == "gated-delta":
            from minivllm.bench.gated_delta import main as run

            report = run(args.out)
        elif args.which == "serving":
            from minivllm.bench.serving import main as run

            options = {"model": args.model}
            if args.rates:
                options["rates"] = [float(r) for r in args.rates.split(",")]
            if args.num_requests:
                options["num_requests"] = args.num_requests
            report = run(args.out, **options)
        elif args.which == "tp":
            from minivllm.bench.tensor_parallel import main as run

            report = run(args.out)
        else:
            from minivllm.bench.kernels import main as run

            report = run(args.out)
        print(json.dumps(report, indent=2, default=str))


def run_chat(args, input=input, output=sys.stdout) -> None:
    """A conversation in the terminal: each turn goes through the chat template with the
    whole history, and the answer streams as it is generated. /reset forgets, /exit ends."""
    from minivllm import LLM, SamplingParams
    from minivllm.tokenizer import encode_chat

    llm = LLM(args.model)
    tokenizer = llm.get_tokenizer()
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SystemExit("this model's tokenizer has no chat template: use 'minivllm generate'")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    print("chat with the model; /reset starts over, /exit (or Ctrl-D) ends", file=output, flush=True)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=output)
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids, text = encode_chat(tokenizer, messages)
        prompt = {"prompt_token_ids": ids, "prompt": text}
        answer = []
        try:
            for delta in llm.stream(prompt, params):
                answer.append(delta)
                print(delta, end="", flush=True, file=output)
        except ValueError as e:  # the conversation outgrew the context
            messages.pop()
            print(f"[{e}; /reset to start over]", file=output, flush=True)
            continue
        print(file=output, flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})


if __name__ == "__main__":
    main()
