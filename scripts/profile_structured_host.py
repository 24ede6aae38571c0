"""The host's work in one constrained decode step (chapter 18), on any machine (the CPU included).

A step with a grammar on every row does, on the host, besides what any step does: each row's
matcher takes the token the last step sampled (``StructuredOutputs.after_sample``), then
the batch's bitmask is filled (``StructuredOutputs.bitmask``: every matcher writes its row, the JSON
token filter is ANDed in) and readied for its copy to the device (pinned memory). None of it
touches the model, so this script drives those two engine functions alone, with stand-ins for
the engine and its requests, for ``--rows`` requests of the bench's JSON schema
(scripts/bench_structured.py) whose grammars have already taken a random prefix of a valid
JSON answer tokenized by the real tokenizer; each step then feeds every row the answer's next
token. It times the whole of both functions per step, and apart (on the same states) the
pieces: the bitmask's allocation, the matchers' fill on the batch matcher's threads and one
row at a time (per row), the token filter's AND, the preparation of the copy to the device
(``pin_memory``, as the sampler does) and the matchers' accept. What the wholes spend beyond
their pieces is Python per row.

The grammar's cost depends on the vocabulary it is compiled against: give the real one
(``--tokenizer``: a folder with Qwen3's tokenizer.json, 151,669 tokens in 151,936 logits). Without
it the bundled model's 8,192-token tokenizer is used, and the report says so.

    python scripts/profile_structured_host.py --tokenizer DIR [--rows 256] [--steps 32] [--threads N] [--profile]

Thread counts are the batch matcher's (``matcher.fill_threads()``: half the cores this process
may use, at most 8; ``--threads`` to try others): on a 2-core machine one thread, on a 16-core
GPU host eight.
"""
import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from minivllm.structured.feature import StructuredOutputs
from minivllm.structured import matcher
from minivllm.structured.compiler import GrammarCompiler
from minivllm.structured.params import StructuredOutputsParams

# scripts/bench_structured.py's schema (its strings are free: dense masks inside them, sparse
# between them).
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "summary": {"type": "string"}},
    "required": ["title", "year", "tags", "summary"]}
WORDS = ("the old man and sea river city night light story of a with far out in his boat day long fish "
         "struggle giant marlin gulf stream town war peace love time heart world young woman home journey "
         "north south winter summer across through silent lost found memory dream garden letter").split()
BUNDLED = Path(__file__).resolve().parents[1] / "minivllm" / "assets" / "bundled"


def answer(rng: random.Random) -> str:
    """A valid answer to SCHEMA, in the compact form the grammar allows (", " and ": ")."""
    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    return json.dumps({"title": words(1, 6).title(), "year": rng.randint(1800, 2024),
                       "tags": [words(1, 2) for _ in range(rng.randint(1, 4))], "summary": words(20, 120) + "."})


def load_tokenizer(folder: str | None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder or str(BUNDLED))


def time_it(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


class Rows:
    """``rows`` requests in the middle of their answers: stand-ins for the engine's
    RequestState (grammar, seq, group), each with the tokens it is still to take."""

    def __init__(self, compiler, tokenizer, params, rows: int, steps: int, seed: int = 0):
        rng = random.Random(seed)
        compiled = compiler.compile(params)
        token_filter = compiler.token_filter(params)
        self.requests, self.todo = [], []
        for i in range(rows):
            while True:
                ids = tokenizer.encode(answer(rng), add_special_tokens=False)
                if len(ids) > steps + 1:
                    break
            cut = rng.randint(0, len(ids) - steps - 1)  # every row still inside its answer after `steps`
            grammar = matcher.GrammarState(compiled, token_filter)
            for t in ids[:cut]:
                if not grammar.accept(t):
                    raise RuntimeError(f"the grammar refuses token {t} of a valid answer: {tokenizer.decode(ids)!r}")
            seq = SimpleNamespace(request_id=str(i), is_finished=False)
            request = SimpleNamespace(grammar=grammar, seq=seq)
            request.group = [request]
            request.group = [request]
            self.requests.append(request)
            self.todo.append(ids[cut:])


def engine_stand_in(rows: Rows, vocab_size: int, device: torch.device):
    """The engine's structured-output feature, alone, over these rows."""
    return StructuredOutputs(None, vocab_size, set(), device.type == "cuda", None,
                             {r.seq.request_id: r for r in rows.requests}, None, None)


def step(engine, rows: Rows, k: int, check: bool = True) -> tuple[torch.Tensor, float, float]:
    """One step's host work: the mask (each row's next token must be allowed), then the accept."""
    start = time.perf_counter()
    bitmask = engine.bitmask(rows.requests)
    mask_s = time.perf_counter() - start
    tokens = [todo[k] for todo in rows.todo]
    if check:
        words = bitmask[torch.arange(len(tokens)), torch.tensor(tokens) // 32]
        allowed = (words >> (torch.tensor(tokens, dtype=torch.int32) % 32)) & 1
        if not allowed.all():
            raise AssertionError(f"rows {allowed.eq(0).nonzero().flatten().tolist()} refuse their next valid token")
    launched = SimpleNamespace(requests=rows.requests, drafts=[[]] * len(tokens), first_rows=list(range(len(tokens))))
    sampled = SimpleNamespace(token_ids=tokens, errors={})
    start = time.perf_counter()
    refused = engine.after_sample(launched, sampled, None)
    accept_s = time.perf_counter() - start
    if check and refused:
        raise AssertionError("a grammar refused its next valid token")
    return bitmask, mask_s, accept_s


def pieces(rows: Rows, vocab_size: int, k: int, device: torch.device) -> dict:
    """The parts of one step, timed apart on the same states (filling does not move a matcher;
    the accept is timed on forks, so the rows stay where they are)."""
    states = [r.grammar for r in rows.requests]
    words = matcher.bitmask_words(vocab_size)
    out = {"alloc_s": time_it(lambda: torch.full((len(states), words), -1, dtype=torch.int32), 3)}
    bitmask = torch.full((len(states), words), -1, dtype=torch.int32)
    batch = matcher._batch_matcher()
    handles, indices = [s.matcher for s in states], list(range(len(states)))
    out["fill_batch_s"] = time_it(lambda: batch.batch_fill_next_token_bitmask(handles, bitmask, indices), 3)
    per_row = [time_it(lambda s=s, i=i: s.matcher.fill_next_token_bitmask(bitmask, i)) for i, s in enumerate(states)]
    out.update(fill_rows_s=sum(per_row), fill_row_median_s=statistics.median(per_row), fill_row_max_s=max(per_row))
    token_filter = states[0].token_filter
    if token_filter is not None:
        out["filter_and_s"] = time_it(lambda: bitmask.__iand__(token_filter), 3)
    if device.type == "cuda":  # what the sampler does with a bitmask in pageable memory
        out["pin_s"] = time_it(lambda: bitmask.pin_memory(), 3)
        pinned = bitmask.pin_memory()
        torch.cuda.synchronize()
        out["h2d_s"] = time_it(lambda: (pinned.to(device, non_blocking=True), torch.cuda.synchronize()), 3)
    else:  # no pinned memory without a GPU: a copy into fresh memory, the host's share of pin_memory()
        out["copy_s"] = time_it(lambda: bitmask.clone(), 3)
    forks = [s.matcher.fork() for s in states]
    tokens = [todo[k] for todo in rows.todo]
    out["accept_batch_s"] = time_it(lambda: batch.batch_accept_token(forks, tokens))
    return out


def summary(values: list[float]) -> dict:
    return {"median_ms": statistics.median(values) * 1e3, "min_ms": min(values) * 1e3, "max_ms": max(values) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="folder of the tokenizer to compile against (default: the bundled one)")
    parser.add_argument("--vocab-size", type=int, default=151936, help="the model's logits (Qwen3-0.6B's)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--any-whitespace", action="store_true", help="disable_any_whitespace=False")
    parser.add_argument("--threads", type=int, help="the batch matcher's threads (default: matcher.fill_threads())")
    parser.add_argument("--profile", action="store_true", help="cProfile the steps and print the top functions")
    parser.add_argument("--out", help="write the report (JSON) here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads or matcher.fill_threads()
    if args.threads:  # this thread's batch matcher, made here with the count asked for
        import xgrammar as xgr

        matcher._per_thread.matcher = xgr.BatchGrammarMatcher(max_threads=args.threads)
    tokenizer = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    stop = [t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)]
    compiler = GrammarCompiler(tokenizer, args.vocab_size, sorted(set(stop)))
    tokenizer_info_s = time.perf_counter() - start
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=not args.any_whitespace)
    rows = Rows(compiler, tokenizer, params, args.rows, args.steps + 4)  # (+ 4: warm-up steps)
    engine = engine_stand_in(rows, args.vocab_size, device)
    for k in range(4):
        step(engine, rows, k)
    report = {"tokenizer": args.tokenizer or "bundled (8,192 tokens: not Qwen3's vocabulary)",
              "tokenizer_tokens": len(tokenizer), "vocab_size": args.vocab_size, "rows": args.rows,
              "steps": args.steps, "fill_threads": threads, "device": str(device),
              "token_filter": rows.requests[0].grammar.token_filter is not None,
              "tokenizer_info_s": tokenizer_info_s, "compile_s": compiler.compile_seconds[-1]}
    masks, accepts, parts = [], [], []
    profiler = cProfile.Profile() if args.profile else None
    for k in range(4, 4 + args.steps):
        if k % 4 == 0:  # the pieces now and then (they cost as much again)
            parts.append(pieces(rows, args.vocab_size, k, device))
        if profiler:
            profiler.enable()
        _, mask_s, accept_s = step(engine, rows, k, check=not profiler)
        if profiler:
            profiler.disable()
        masks.append(mask_s)
        accepts.append(accept_s)
    report["bitmask_total"] = summary(masks)
    report["accept_total"] = summary(accepts)
    report["host_total_median_ms"] = statistics.median(m + a for m, a in zip(masks, accepts)) * 1e3
    report["pieces_median_ms"] = {key.removesuffix("_s"): statistics.median(p[key] for p in parts) * 1e3
                                  for key in parts[0]}
    print(json.dumps(report, indent=1))
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
