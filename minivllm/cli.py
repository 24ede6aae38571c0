"""``minivllm generate | chat | serve | bench``; every command defaults to the bundled model."""
import argparse
import dataclasses
import importlib
import json
import logging
import sys
import types

MODEL_HELP = "a local folder or hub id (default: the bundled model)"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # as server.serving_engine's (not imported: it needs fastapi)


# The engine fields that are LLM()'s own arguments rather than engine arguments, or that a
# command line has no use for (the model is the command's; record_trace is for notebooks).
NOT_ENGINE_FLAGS = ("model", "record_trace")
# ``minivllm bench WHICH`` runs the ``main`` of this module of minivllm.bench.
BENCHMARKS = {"throughput": "throughput", "latency": "latency", "kernels": "kernels", "moe": "moe",
              "gated-delta": "gated_delta", "serving": "serving", "tp": "tensor_parallel"}


def engine_fields():
    """EngineConfig's fields, each of which ``add_engine_args`` makes a flag."""
    from minivllm.config import EngineConfig

    return [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_ENGINE_FLAGS]


def engine_args(args) -> dict:
    """The engine arguments a command line gave; a flag left out is left to the engine's
    default. A value given is passed on as it is, zero and False included, for EngineConfig
    to honour or refuse (``--max-num-seqs 0`` is an error, not the default)."""
    given = {f.name: getattr(args, f.name, None) for f in engine_fields()}
    return {name: value for name, value in given.items() if value is not None}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """A flag for every EngineConfig field (``max_num_seqs`` -> ``--max-num-seqs``; a bool
    gets its ``--no-`` twin), so that a new engine setting is on the command line at once."""
    group = parser.add_argument_group("engine", "EngineConfig's fields (left out: the engine's default)")
    for f in engine_fields():
        flag = "--" + f.name.replace("_", "-")
        kinds = set(f.type.__args__) - {type(None)} if isinstance(f.type, types.UnionType) else {f.type}
        default = None if f.default is dataclasses.MISSING else f.default
        if f.name == "dtype":
            group.add_argument(flag, default=None, help="auto (default), float32, bfloat16 or float16")
        elif f.name == "device":
            group.add_argument(flag, default=None, help="default: cuda if there is a GPU, else cpu")
        elif kinds == {bool}:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=f"default: {'the engine decides' if default is None else default}")
        elif kinds == {dict}:  # e.g. --speculative-config '{"method": "ngram", ...}'
            group.add_argument(flag, type=json.loads, default=None, help="a JSON object; default: none")
        elif len(kinds) == 1 and kinds <= {int, float, str}:
            group.add_argument(flag, type=kinds.pop(), default=None,
                               help=f"default: {'the engine decides' if default is None else default}")
        else:
            raise TypeError(f"EngineConfig.{f.name}: no command-line flag for a field of type {f.type}")


# What one request may cost, and what happens past each limit (tests/test_server_bounded_cost.py
# checks the numbers against the server's own). Without a flag: fixed.
SERVE_LIMITS = """\
limits per request (refused before any work, with the status shown):
  body                  16 MiB (--max-request-bytes)                               413
  JSON in the body      100,000 objects and keys, counted before it is parsed      400
  prompts               256 per /v1/completions batch (--max-prompts)              400
  prompt                max_model_len tokens, and that many tokens' characters     400
  logprob entries       prompts x n x tokens x (top-k + 1), 1,000,000
                        (--max-logprob-entries)                                    400
  messages              4,096 per chat or /tokenize request, 256 parts each        400
  tools                 128 per request, 128 tool calls per message; their JSON
                        counts towards the prompt's characters                     400
  stop strings          64 of 256 characters; 256 stop_token_ids (--max-stop...)   400
  logit_bias            300 tokens                                                 400
  grammar compile       10 s per spec; one compile in flight per client address,
                        30 s at most waiting for its turn                      400 / 429
  connection            the request head within 10 s; 5 s idle after a response   closed
"""


def server_config(args):
    """The ServerConfig a ``serve`` command line gave."""
    from minivllm.server.api import ServerConfig
    from minivllm.tokenizer import resolve_chat_template

    config = ServerConfig(api_key=args.api_key)
    for name in ("max_request_bytes", "max_stop", "max_stop_chars", "max_stop_token_ids", "max_prompts",
                 "max_logprob_entries"):
        if getattr(args, name, None) is not None:
            setattr(config, name, getattr(args, name))
    if getattr(args, "chat_template", None) is not None:
        config.chat_template = resolve_chat_template(args.chat_template)
    config.trust_request_chat_template = bool(getattr(args, "trust_request_chat_template", False))
    if getattr(args, "tool_call_parser", None) is not None:
        config.tool_call_parser = args.tool_call_parser
    if args.allowed_hosts is not None:
        config.allowed_hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    elif args.host not in LOOPBACK_HOSTS:
        config.allowed_hosts = ["*"]  # reached by whatever name the network gives it
    if args.allowed_origins is not None:
        config.allowed_origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    return config


def uses_engine_process(args) -> bool:
    """``--engine-process``, or its default: on for a GPU, where the device would wait while
    the engine's host work and HTTP take turns on one interpreter lock; off on a CPU, where
    the forward pass runs on the host's cores and is most of the time per token (HTTP is
    about 7% of the bundled model's CPU time per token), a second busy process
    takes cores from the model's threads, and one process starts faster and is simpler to
    debug."""
    if args.engine_process is not None:
        return args.engine_process
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device.startswith("cuda")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt, streaming the text")
    gen.add_argument("prompt")
    chat = sub.add_parser("chat", help="talk to the model in the terminal (multi-turn, streaming)")
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    for command, max_tokens, temperature in ((gen, 64, 0.8), (chat, 128, 0.7)):
        command.add_argument("--model", default=None, help=MODEL_HELP)
        command.add_argument("--max-tokens", type=int, default=max_tokens)
        command.add_argument("--temperature", type=float, default=temperature)
        command.add_argument("--seed", type=int, default=None)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server", epilog=SERVE_LIMITS,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP + " (or --model)")
    serve.add_argument("--model", default=None, help=MODEL_HELP)
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients ask for (default: the model as given, or 'bundled')")
    serve.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health and /metrics")
    serve.add_argument("--max-prompts", type=int, default=None, help="prompts per /v1/completions batch (default 256)")
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one, to use "
                                                             "instead of the tokenizer's")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in requests (a template is code the server runs)")
    serve.add_argument("--tool-call-parser", default=None, choices=["hermes", "qwen", "llama3_json"],
                       help="how tool_choice=auto reads the model's tool calls (default hermes: Qwen's and "
                            "Hermes' <tool_call> JSON)")
    serve.add_argument("--max-request-bytes", type=int, default=None, help="refuse bigger bodies (default 16 MiB)")
    serve.add_argument("--max-stop", type=int, default=None, help="stop strings per request (default 64)")
    serve.add_argument("--max-stop-chars", type=int, default=None, help="characters per stop string (default 256)")
    serve.add_argument("--max-stop-token-ids", type=int, default=None, help="stop_token_ids per request (default 256)")
    serve.add_argument("--max-logprob-entries", type=int, default=None,
                       help="log-probability entries per request: prompts x n x tokens x (top-k + 1) "
                            "(default 1,000,000)")
    serve.add_argument("--allowed-hosts", default=None,
                       help="comma-separated Host names to answer to; '*' for any (default: loopback names when "
                            "--host is loopback, else any)")
    serve.add_argument("--allowed-origins", default=None,
                       help="comma-separated origins whose web pages may call the API (CORS; default: none)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine core in a process of its own, beside the HTTP server's (default: on for "
                            "a GPU, off on a CPU)")
    add_engine_args(serve)

    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, kernels, moe, gated-delta, tp: a CUDA GPU; serving: any)")
    bench.add_argument("which", choices=list(BENCHMARKS))
    bench.add_argument("--out", default="benchmarks")
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--engine", type=json.loads, default=None,
                       help="throughput: EngineConfig fields for the engine, as a JSON object (e.g. "
                            "'{\"max_num_batched_tokens\": 16384}'; default: the engine's defaults)")
    bench.add_argument("--model", default=None, help="serving: the model (default: Qwen3-0.6B shapes on a GPU, "
                                                     "the bundled model on a CPU)")
    bench.add_argument("--rates", default=None, help="serving: request rates per second, comma-separated; inf = all at once")
    bench.add_argument("--num-requests", type=int, default=None, help="serving: requests per rate")
    bench.add_argument("--base-url", default=None,
                       help="serving: measure this running OpenAI-compatible server instead of starting one")
    bench.add_argument("--api-key", default=None, help="serving with --base-url: the server's key")
    bench.add_argument("--vocab", type=int, default=1000,
                       help="serving with --base-url: prompts are token ids below this (default 1000)")
    bench.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="serving: the server's engine core in a process of its own, or not (default: as "
                            "'minivllm serve' decides)")
    bench.add_argument("--client-processes", type=int, default=None,
                       help="serving: processes that send the load and read the streams (default: 4 on a GPU, 1 on "
                            "a CPU)")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model or args.model_tag
    return args


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)

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
        from minivllm.server.api import serve as run_server
        from minivllm.server.async_engine import AsyncLLMEngine

        try:
            config = server_config(args)
        except ValueError as e:  # a --chat-template that is neither a file nor a template
            parser.error(str(e))
        if args.host not in LOOPBACK_HOSTS and args.api_key is None:
            print(f"warning: serving on {args.host} with no --api-key: anyone who can reach it can use it",
                  file=sys.stderr)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
        try:
            if uses_engine_process(args):
                from minivllm.server.engine_client import EngineCoreClient

                engine = EngineCoreClient(args.model, **engine_args(args))
            else:
                engine = AsyncLLMEngine.from_model(args.model, **engine_args(args))
        except ValueError as e:  # a flag EngineConfig refuses (--max-num-seqs 0), a model past its limits
            parser.error(str(e))
        name = args.served_model_name or (args.model or "bundled")
        sys.exit(run_server(engine, name, args.host, args.port, config))
    elif args.command == "bench":
        options = {}
        if args.which == "throughput":
            options["with_transformers"] = not args.no_transformers
            if args.engine:
                options["engine_args"] = args.engine
        elif args.which == "serving":
            options["model"] = args.model
            if args.rates:
                options["rates"] = [float(r) for r in args.rates.split(",")]
            if args.num_requests:
                options["num_requests"] = args.num_requests
            if args.base_url:
                options.update(base_url=args.base_url, api_key=args.api_key, vocab=args.vocab)
            if args.engine_process is not None:
                options["engine_process"] = args.engine_process
            if args.client_processes is not None:
                options["client_processes"] = args.client_processes
        run = importlib.import_module(f"minivllm.bench.{BENCHMARKS[args.which]}").main
        print(json.dumps(run(args.out, **options), indent=2, default=str))


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
