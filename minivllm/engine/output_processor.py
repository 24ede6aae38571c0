"""After the model: each sampled token goes back to its request — appended, detokenized,
checked against the stop conditions — and a request that finished (or streams) becomes a
``RequestOutput``.

Everything here is per request and on the host. What can be worked out once was worked out
when the request arrived (``engine.input_processor``): the ids that end it, the ids banned
before ``min_tokens``, the automaton that finds its stop strings. So the cost per token does
not grow with how many stop strings or stop ids a request carries.
"""
from minivllm.engine.request_state import RequestState
from minivllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SpecDecodeMetrics


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append_token(self, request: RequestState, token: int, logprobs) -> str | None:
        """Give the request its new token (and, when it asked for logprobs, the token's scores,
        its log-probability added to cumulative_logprob); return why it finishes ("stop",
        "length"), or None."""
        seq, params = request.seq, request.seq.sampling_params
        seq.token_ids.append(token)
        request.metrics.token_arrived()
        if logprobs is not None:
            request.cumulative_logprob += logprobs[0]
            request.logprobs.append(self._logprob_entry(token, *logprobs))
        # Stop conditions apply once min_tokens tokens exist (as in vLLM). EOS and stop ids
        # cannot be among the first min_tokens anyway: the sampler was not allowed them.
        past_min = seq.num_output_tokens >= params.min_tokens
        if not params.ignore_eos and token in self.eos_token_ids and past_min:
            request.stop_reason = None
            return self._stopped_by_token(request)
        if token in request.stop_token_ids and past_min:
            request.stop_reason = token
            return self._stopped_by_token(request)
        if request.detokenizer is not None:
            before = len(request.text)
            request.text += request.detokenizer.step(seq.output_token_ids)
            if request.stop_strings is not None:
                # The automaton reads every character, before min_tokens too, so that a stop
                # string straddling that point is still found once it counts.
                request.stop_state, at, stop = request.stop_strings.feed(
                    request.stop_state, request.text, before, report=past_min)
                if at is not None:
                    request.text = request.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                    request.stop_reason = stop
                    return "stop"
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
                seq.num_tokens >= self.max_model_len):
            return "length"
        return None

    def _logprob_entry(self, token: int, chosen: float, rank: int, top_ids: list[int],
                       top_values: list[float]) -> dict[int, Logprob]:
        """One step's logprobs: the top tokens, and the chosen one if it ranked below them."""
        entry = {tid: Logprob(v, rank=r + 1, decoded_token=self._decode_one(tid))
                 for r, (tid, v) in enumerate(zip(top_ids, top_values))}
        if token not in entry:
            entry[token] = Logprob(chosen, rank=rank, decoded_token=self._decode_one(token))
        return entry

    def _stopped_by_token(self, request: RequestState) -> str:
        """A stop token's text is left out of the output unless include_stop_str_in_output
        (as in vLLM; with skip_special_tokens an EOS adds nothing either way)."""
        if request.seq.sampling_params.include_stop_str_in_output and request.detokenizer is not None:
            request.text += request.detokenizer.step(request.seq.output_token_ids)
        return "stop"

    def _decode_one(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def make_output(self, request: RequestState) -> RequestOutput:
        """The output of the request ``request`` belongs to: every completion of its group."""
        first = request.group[0]
        return RequestOutput(
            request_id=first.seq.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(r) for r in request.group],
            finished=all(r.seq.is_finished for r in request.group),
            num_cached_tokens=first.seq.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs if first.seq.sampling_params.prompt_logprobs is not None else None,
            error=next((r.error for r in request.group if r.error is not None), None),
            spec_decode=SpecDecodeMetrics(first.num_draft_tokens, first.num_accepted_tokens, first.num_spec_steps)
            if first.num_spec_steps else None,
            metrics=self._metrics(request.group),
        )

    @staticmethod
    def _metrics(group: list[RequestState]) -> RequestMetrics:
        """The request's metrics: its first completion's, with the latest token of any."""
        first = group[0].metrics
        if len(group) == 1:
            return RequestMetrics(**vars(first))  # a copy: the request's own goes on changing
        last = max((r.metrics.last_token_time for r in group if r.metrics.last_token_time is not None), default=None)
        return RequestMetrics(**{**vars(first), "last_token_time": last})

    def shown_text_len(self, request: RequestState) -> int:
        """How much of the request's text an output shows now. It only grows, so a stream
        can send what is new since its last output."""
        seq = request.seq
        keeps_stop = seq.sampling_params.include_stop_str_in_output
        if request.stop_strings is not None and not seq.is_finished and not keeps_stop:
            # The end of the text may be the start of a stop string that later tokens
            # complete, and then it is cut off: hold it back until that is ruled out, so a
            # stream never sends text it would have to take back. (A stop string kept in
            # the output cuts nothing that was sent: it ends after the text before it.)
            return max(0, len(request.text) - request.stop_strings.hold_back)
        return len(request.text)

    def _completion(self, request: RequestState) -> CompletionOutput:
        seq = request.seq
        want_logprobs = seq.sampling_params.logprobs is not None
        return CompletionOutput(
            index=seq.index,
            text=request.text[: self.shown_text_len(request)],
            token_ids=seq.output_token_ids,  # a slice: already a copy
            cumulative_logprob=request.cumulative_logprob if want_logprobs else None,
            logprobs=list(request.logprobs) if want_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=request.stop_reason,
        )
