"""The book's compatibility page (``book/compatibility.md``), written from the code's own lists
so that it cannot drift from what the code does: ``minivllm serve``'s flags as its parser
declares them, ``LLM(...)``'s keywords from ``engine.engine_args``, ``SamplingParams``' fields,
the server's routes and its request fields. ``tests/test_vllm_dropin_compatibility.py``
checks the page equals ``render()``; after a change, write it again with

    python -m minivllm.compatibility > book/compatibility.md
"""
import argparse
import dataclasses

from minivllm.cli import VLLM_FLAGS, VLLM_VALUES, build_parser
from minivllm.engine.engine_args import ACCEPTED_VLLM_ARGS, ENGINE_ARGS, REFUSED_VLLM_ARGS
from minivllm.sampling_params import SamplingParams

SUPPORTED, ACCEPTED, SOME_VALUES, REFUSED = "supported", "accepted, changes nothing", "some values", "refused"

# SamplingParams' fields that are vLLM's and change nothing here, and why.
SAMPLING_ACCEPTED = {
    "output_kind": "outputs are always cumulative, and LLM.generate returns the final one whatever the kind",
    "extra_args": "carried with the request for custom logits processors; minivllm's engine reads none of it",
    "spaces_between_special_tokens": "the fast tokenizers minivllm uses never put spaces between special tokens",
}
# What each route serves (a route added to the server without a line here fails the page's test).
ROUTES = {
    "/health": "200 while the engine runs, 503 once it has died (no key needed)",
    "/metrics": "Prometheus' text format, under vLLM's family names and buckets (no key needed)",
    "/version": "the server's version",
    "/tokenize": "a prompt or a conversation (through the chat template) to token ids",
    "/detokenize": "token ids to text",
    "/v1/models": "the model's cards, under each served name, with root and parent",
    "/v1/models/{model_id:path}": "one card",
    "/v1/completions": "text or token-id prompts (batched), streamed or whole: n, logprobs, echo, prompt_logprobs, "
                       "structured outputs, vLLM's sampling extensions",
    "/v1/chat/completions": "messages through the chat template, streamed or whole: tools (auto, required, named), "
                            "response_format, reasoning (--reasoning-parser), echo, logprobs",
    "/v1/responses": "OpenAI's Responses API: text or items (messages, function calls and outputs), instructions, "
                     "function tools, text.format, max_output_tokens, streamed in its events",
}
# vLLM's routes this server does not serve, and why.
ROUTES_NOT_SERVED = {
    "/v1/embeddings, /pooling, /classify, /score, /rerank": "minivllm serves generative models only",
    "/v1/audio/transcriptions, /v1/audio/translations": "minivllm serves text models only",
    "/v1/load_lora_adapter, /v1/unload_lora_adapter": "LoRA adapters are not supported",
    "GET /v1/responses/{id}, previous_response_id": "this server stores no responses: send the whole conversation",
}
REQUEST_FIELDS_NOTE = (
    "A request field the server does not know is accepted and ignored, with a log line naming it, as vLLM "
    "does; a field vLLM acts on that this server cannot honour is refused with a 400 naming it, unless it "
    "asks for nothing (its do-nothing default).")


def table(rows: list[tuple[str, str, str]], head: tuple[str, str, str]) -> list[str]:
    def escape(cell: str) -> str:  # (a tag such as <think> would be read as HTML, and vanish)
        return cell.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")

    return [f"| {' | '.join(head)} |", "|---|---|---|", *(f"| {' | '.join(map(escape, row))} |" for row in rows)]


def status_of(name: str) -> str:
    return (ACCEPTED if name in ACCEPTED_VLLM_ARGS else REFUSED if name in REFUSED_VLLM_ARGS
            else SOME_VALUES if name in VLLM_VALUES else SUPPORTED)


def serve_flags() -> list[tuple[str, str, str]]:
    """Every flag of ``minivllm serve``, its status and its help text (which says why)."""
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    rows = []
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        why = (action.help or "").replace("%%", "%").removeprefix("accepted, changes nothing: ")
        status = status_of(action.dest) if action.dest in VLLM_FLAGS else SUPPORTED  # (the server's own flags)
        rows.append((", ".join(f"`{f}`" for f in action.option_strings), status,
                     why.removeprefix("refused: ")))
    return rows


def llm_keywords() -> list[tuple[str, str, str]]:
    """``LLM(...)``'s keywords: the engine's own fields, and vLLM's as ``vllm_engine_args`` reads them."""
    names = sorted(ENGINE_ARGS | {"model", "dtype", "device"} | set(VLLM_VALUES) | set(ACCEPTED_VLLM_ARGS)
                   | set(REFUSED_VLLM_ARGS))
    why = {**VLLM_VALUES, **ACCEPTED_VLLM_ARGS, **REFUSED_VLLM_ARGS,
           "model": "a local folder, a hub id, or the bundled model if left out", "dtype": "auto, float32, bfloat16 "
           "or float16", "device": "cuda if there is a GPU, else cpu"}
    return [(f"`{name}`", status_of(name), why.get(name, "an EngineConfig field (see minivllm.config)"))
            for name in names]


def sampling_fields() -> list[tuple[str, str, str]]:
    rows = []
    for f in dataclasses.fields(SamplingParams):
        status = ACCEPTED if f.name in SAMPLING_ACCEPTED else SUPPORTED
        why = SAMPLING_ACCEPTED.get(f.name, "")
        if f.name == "detokenize":
            why = "False leaves the outputs' text empty (and refuses stop strings, which are found in the text)"
        if f.name == "logprobs":
            why = "up to --max-logprobs (20); -1, the whole vocabulary, with max_logprobs=-1"
        rows.append((f"`{f.name}`", status, why))
    rows.append(("any other name", REFUSED, "a TypeError naming the closest field (a typo is never ignored)"))
    return rows


def routes() -> list[tuple[str, str, str]]:
    from minivllm.server import api

    rows = []
    for router in (api.open_routes, api.keyed, api.v1):
        for route in router.routes:
            what = ROUTES[route.path]
            rows += [(f"`{method} {route.path}`", SUPPORTED, what) for method in sorted(route.methods)]
    rows += [(f"`{paths}`", REFUSED, why) for paths, why in ROUTES_NOT_SERVED.items()]
    return rows


def request_fields() -> list[tuple[str, str, str]]:
    from minivllm.server.protocol import NOT_SUPPORTED, ChatCompletionRequest, CompletionRequest, ResponsesRequest

    rows = [(f"`{model.__name__}`", SUPPORTED, ", ".join(f"`{f}`" for f in sorted(model.model_fields)))
            for model in (CompletionRequest, ChatCompletionRequest, ResponsesRequest)]
    rows.append(("elsewhere (a request that does not declare them): unless they ask for nothing", REFUSED,
                 ", ".join(f"`{f}`" for f in sorted(NOT_SUPPORTED))))
    return rows


def render() -> str:
    head = ("name", "status", "what it does here, or why not")
    parts = [
        "# Compatibility with vLLM",
        "",
        "What a vLLM user brings to minivllm: each flag of `minivllm serve` (vLLM's, and minivllm's own), each "
        "keyword of `LLM(...)`, each field of `SamplingParams`, each route and request field of the server, "
        f"marked **{SUPPORTED}**, **{SOME_VALUES}** (the values honoured), **{ACCEPTED}** (and why) or "
        f"**{REFUSED}** (and what to do instead). A name neither vLLM nor minivllm knows is an error that names "
        "the closest known one.",
        "",
        "This page is written from the code (`python -m minivllm.compatibility > book/compatibility.md`) "
        "and a test keeps the two equal.",
        "", "## `minivllm serve` flags", "", *table(serve_flags(), head),
        "", "## `LLM(...)` keywords", "", *table(llm_keywords(), head),
        "", "## `SamplingParams` fields", "", *table(sampling_fields(), head),
        "", "## Routes", "", *table(routes(), ("route", "status", "what it does, or why not")),
        "", "## Request fields", "", REQUEST_FIELDS_NOTE, "",
        *table(request_fields(), ("request", "status", "fields")),
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
