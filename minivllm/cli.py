"""``minivllm generate | chat | serve | bench``; every command defaults to the bundled model."""
import argparse
import dataclasses
import difflib
import importlib
import json
import logging
import sys
import types

MODEL_HELP = "a local folder or hub id (default: the bundled model)"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # as server.serving_engine's (not imported: it needs fastapi)


# The engine fields that are LLM()'s own arguments rather than engine arguments, or that a
# command line has no use for (the model is the command's; record_trace is for notebooks).
NOT_ENGINE_FLAGS = ("model", "record_trace", "quantization")  # quantization: vLLM's flag (VLLM_FLAGS)
# ``minivllm bench WHICH`` runs the ``main`` of this module of minivllm.bench.
BENCHMARKS = {"throughput": "throughput", "latency": "latency", "kernels": "kernels", "moe": "moe",
              "gated-delta": "gated_delta", "serving": "serving", "tp": "tensor_parallel",
              "quantization": "quantization"}


def engine_fields():
    """EngineConfig's fields, each of which ``add_engine_args`` makes a flag."""
    from minivllm.config import EngineConfig

    return [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_ENGINE_FLAGS]


# vLLM's engine flags that ``add_vllm_args`` gives ``serve``, as engine_args.vllm_engine_args
# understands them (accepted with a notice, honoured for some values, or refused by name).
VLLM_FLAGS = {  # flag name -> (its argparse keywords, a short alias or None)
    "trust_remote_code": ({"action": "store_true"}, None),
    "enable_auto_tool_choice": ({"action": "store_true"}, None),
    "disable_log_stats": ({"action": "store_true"}, None),
    "disable_custom_all_reduce": ({"action": "store_true"}, None),
    "enable_chunked_prefill": ({"action": argparse.BooleanOptionalAction}, None),
    "enable_lora": ({"action": "store_true"}, None),
    "tokenizer": ({}, None), "revision": ({}, None), "quantization": ({}, "-q"),
    "tokenizer_mode": ({}, None), "download_dir": ({}, None), "load_format": ({}, None),
    "lora_modules": ({"nargs": "+"}, None),
    "limit_mm_per_prompt": ({}, None), "mm_processor_kwargs": ({}, None),
    "swap_space": ({"type": float}, None), "cpu_offload_gb": ({"type": float}, None),
    "pipeline_parallel_size": ({"type": int}, "-pp"), "data_parallel_size": ({"type": int}, "-dp"),
    "max_loras": ({"type": int}, None), "max_lora_rank": ({"type": int}, None),
}


# The flags of VLLM_FLAGS that some values of are honoured.
VLLM_VALUES = {
    "tokenizer": "the model's own only (its name or folder): the tokenizer is read from the model's folder",
    "revision": "a hub id's branch, tag or commit to load",
    "quantization": "fp8: quantize the linear layers' weights to fp8 at load (W8A8); auto or none: weights as the "
                    "checkpoint has them (an fp8 checkpoint loads as published either way)",
    "enable_chunked_prefill": "always on here: a long prompt is split across steps (max_num_batched_tokens)",
    "pipeline_parallel_size": "1 only: split a model across GPUs with --tensor-parallel-size",
}


def engine_args(args) -> dict:
    """The engine arguments a command line gave; a flag left out is left to the engine's
    default. A value given is passed on as it is, zero and False included, for EngineConfig
    to honour or refuse (``--max-num-seqs 0`` is an error, not the default). vLLM's flags
    (``VLLM_FLAGS``) given are passed on too, for ``LLMEngine.from_engine_args`` to read."""
    given = {f.name: getattr(args, f.name, None) for f in engine_fields()}
    given.update({name: getattr(args, name, None) for name in VLLM_FLAGS})
    return {name: value for name, value in given.items() if value is not None}


def checked_engine_args(args) -> dict:
    """``engine_args(args)``, vLLM's flags among them checked now, before any weight is
    loaded (a refused one is a usage error, in either engine mode), each accepted flag's
    notice logged once."""
    from minivllm.engine.engine_args import vllm_engine_args

    given = engine_args(args)
    tokenizer = given.pop("tokenizer", None)
    checked, revision = vllm_engine_args(given)
    return {**checked, **{k: v for k, v in (("tokenizer", tokenizer), ("revision", revision)) if v is not None}}


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM's flags", "accepted so that a vLLM command line starts unchanged: each either acts as in vLLM, "
        "changes nothing here (a notice at startup says why), or is refused with what minivllm does instead")
    from minivllm.engine.engine_args import ACCEPTED_VLLM_ARGS, REFUSED_VLLM_ARGS

    group.add_argument("--max-logprobs", type=int, default=None,
                       help="top log-probabilities a request may ask for per token, at most 20; -1 lets logprobs=-1 "
                            "ask for the whole vocabulary (within --max-logprob-entries) (default 20)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="log no line per request (uvicorn's access log)")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"], help="default: info")
    group.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                       help="a reasoning model's <think> text goes to the answer's reasoning (and reasoning_content) "
                            "field, apart from its content, and a chat request's grammar (response_format, tools) "
                            "starts after </think> (default: it stays in the content)")
    for name, (kwargs, alias) in VLLM_FLAGS.items():
        flags = ["--" + name.replace("_", "-")] + ([alias] if alias else [])
        help_text = (f"accepted, changes nothing: {ACCEPTED_VLLM_ARGS[name]}" if name in ACCEPTED_VLLM_ARGS else
                     f"refused: {REFUSED_VLLM_ARGS[name]}" if name in REFUSED_VLLM_ARGS else VLLM_VALUES[name])
        group.add_argument(*flags, dest=name, default=None, help=help_text.replace("%", "%%"), **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """A flag for every EngineConfig field (``max_num_seqs`` -> ``--max-num-seqs``; a bool
    gets its ``--no-`` twin), so that a new engine setting is on the command line at once."""
    group = parser.add_argument_group("engine", "EngineConfig's fields (left out: the engine's default)")
    for f in engine_fields():
        flag = "--" + f.name.replace("_", "-")
        if f.name == "tensor_parallel_size":  # vLLM's short form
            group.add_argument(flag, "-tp", type=int, default=None, help="default: 1")
            continue
        kinds = set(f.type.__args__) - {type(None)} if isinstance(f.type, types.UnionType) else {f.type}
        default = None if f.default is dataclasses.MISSING else f.default
        if f.name == "dtype":
            group.add_argument(flag, default=None, help="auto (default), float32, bfloat16 or float16")
        elif f.name == "kv_cache_dtype":
            group.add_argument(flag, default=None, help="auto (default: the model's dtype), fp8 or fp8_e4m3 (float8 "
                                                        "e4m3, a scale per layer: twice the blocks of bf16)")
        elif f.name == "calculate_kv_scales":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help="with --kv-cache-dtype fp8: each layer's key and value scales from the first "
                                    "prompt's largest key and value over 448 (default: the checkpoint's, or 1.0)")
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
    from minivllm.engine.engine_args import BUNDLED_MODEL
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
    config.reasoning_parser = getattr(args, "reasoning_parser", None)
    if args.allowed_hosts is not None:
        config.allowed_hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    elif args.host not in LOOPBACK_HOSTS:
        config.allowed_hosts = ["*"]  # reached by whatever name the network gives it
    if args.allowed_origins is not None:
        config.allowed_origins = origins(args.allowed_origins)
    if getattr(args, "max_logprobs", None) is not None:
        from minivllm.sampling_params import check_max_logprobs

        config.max_logprobs = check_max_logprobs(args.max_logprobs)
    config.model_aliases = list((getattr(args, "served_model_name", None) or [])[1:])
    config.model_root = getattr(args, "model", None) or str(BUNDLED_MODEL)
    return config


def origins(value: str) -> list[str]:
    """``--allowed-origins``: vLLM's JSON list (``'["https://a.example", "*"]'``) or minivllm's
    comma-separated names."""
    if value.lstrip().startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
            raise ValueError(f"--allowed-origins {value!r}: a JSON list of strings, or names separated by commas")
        return [o.strip() for o in parsed if o.strip()]
    return [o.strip() for o in value.split(",") if o.strip()]


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
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the name(s) clients ask for; the first is the one answers report, the others are "
                            "aliases (default: the model as given, or 'bundled')")
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
                       help="origins whose web pages may call the API (CORS), comma-separated or as vLLM's JSON list "
                            "'[\"https://a.example\"]' (default: none)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine core in a process of its own, beside the HTTP server's (default: on for "
                            "a GPU, off on a CPU)")
    add_engine_args(serve)
    add_vllm_args(serve)

    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, kernels, moe, gated-delta, tp: a CUDA GPU; serving: any)")
    bench.add_argument("which", choices=list(BENCHMARKS))
    bench.add_argument("--out", default="benchmarks")
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--engine", type=json.loads, default=None,
                       help="throughput: EngineConfig fields for the engine, as a JSON object (e.g. "
                            "'{\"max_num_batched_tokens\": 16384}'; default: the engine's defaults)")
    bench.add_argument("--quantization", "-q", default=None,
                       help="throughput, latency: fp8 quantizes the linear layers' weights at load (default: bf16 "
                            "weights)")
    bench.add_argument("--kv-cache-dtype", default=None,
                       help="throughput, latency: the KV cache's dtype, auto (default) or fp8")
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
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        refuse_unknown(parser, args, unknown)
    if args.command == "serve":
        if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model or args.model_tag
    return args


def refuse_unknown(parser: argparse.ArgumentParser, args, unknown: list[str]) -> None:
    """argparse's error for arguments nobody knows, each flag with the closest known one (a
    typo, most often)."""
    command = next(a for a in parser._subparsers._actions if isinstance(a, argparse._SubParsersAction))
    known = [flag for action in command.choices[args.command]._actions for flag in action.option_strings]
    parts = []
    for arg in unknown:
        flag = arg.partition("=")[0]
        close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("-") else []
        parts.append(arg + (f" (did you mean {close[0]}?)" if close else ""))
    parser.error(f"unrecognized arguments: {' '.join(parts)}")


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

        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
        try:
            config = server_config(args)  # (a --chat-template that is neither a file nor a template: ValueError)
            given = checked_engine_args(args)  # vLLM's flags: a refused one ends here, before any loading
        except ValueError as e:
            parser.error(str(e))
        if args.host not in LOOPBACK_HOSTS and args.api_key is None:
            print(f"warning: serving on {args.host} with no --api-key: anyone who can reach it can use it",
                  file=sys.stderr)
        try:
            if uses_engine_process(args):
                from minivllm.server.engine_client import EngineCoreClient

                engine = EngineCoreClient(args.model, **given)
            else:
                engine = AsyncLLMEngine.from_model(args.model, **given)
        except ValueError as e:  # a flag EngineConfig refuses (--max-num-seqs 0), a model past its limits
            parser.error(str(e))
        name = args.served_model_name[0] if args.served_model_name else (args.model or "bundled")
        sys.exit(run_server(engine, name, args.host, args.port, config, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_log_requests))
    elif args.command == "bench":
        options = {}
        if args.which == "throughput":
            options["with_transformers"] = not args.no_transformers
            if args.engine or args.quantization:
                quantization = {} if args.quantization is None else {"quantization": args.quantization}
                options["engine_args"] = {**(args.engine or {}), **quantization}
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
        if args.which in ("throughput", "latency") and args.kv_cache_dtype is not None:
            options["kv_cache_dtype"] = args.kv_cache_dtype
        if args.which == "latency" and args.quantization is not None:
            options["quantization"] = args.quantization
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
