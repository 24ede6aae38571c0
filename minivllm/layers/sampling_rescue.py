"""When a batch's sampling raises: find the rows to blame, so one request's bad values fail
that request alone, not everyone in its batch.

Every row passed validation, so a row that still breaks the sampler is a bug; but a bug one
request triggers must not become a failure for every request that shared its step. Each row
is sampled alone; the rows that fail by themselves are reported (``SamplerOutput.errors``),
and the engine ends those requests with finish_reason "error". If every row fails, no
request is to blame and the batch's own error is raised.
"""
import logging

from minivllm.layers.sampled_tokens import SampledTokens, SamplerOutput

logger = logging.getLogger(__name__)


def sample_rows_alone(sample, batch_error: Exception, logits, params, generators, banned, history,
                      bitmask) -> SampledTokens:
    """``sample`` (``Sampler.sample``) once per row of the batch whose sampling raised
    ``batch_error``; the tokens on the host, a failed row's token -1."""
    out, failed = SamplerOutput([], []), {}
    for row in range(len(params)):
        try:
            one = sample(logits[row : row + 1], params[row : row + 1], generators[row : row + 1],
                         banned[row : row + 1] if banned else None, history.row(row) if history else None,
                         bitmask[row : row + 1] if bitmask is not None else None).to_host()
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
        except NotImplementedError:
            raise  # missing code (an exercise left blank) is nobody's request
        except Exception as e:
            out.token_ids.append(-1)
            out.logprobs.append(None)
            failed[row] = e
    if len(failed) == len(params):
        raise batch_error
    for row, e in failed.items():
        logger.error("sampling failed for batch row %d alone (%s)", row, params[row], exc_info=e)
        out.errors[row] = f"sampling failed: {type(e).__name__}"
    return SampledTokens.on_host(out, logits.device)
