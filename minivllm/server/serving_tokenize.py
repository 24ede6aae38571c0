"""POST /tokenize and /detokenize (vLLM's): a text or a conversation (through the chat
template) to token ids, and token ids back to text. Both want the key: tokenizing is work
done on the caller's behalf."""
import asyncio

from minivllm.server.protocol import APIError, DetokenizeRequest, TokenizeRequest
from minivllm.server.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if body.messages is not None:
            ids, _ = await self.encode_messages(body)
        else:
            ids = await self.encode(body.prompt, body.add_special_tokens)
        strs = await asyncio.to_thread(self.tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        # As long as the longest sequence this server can hold: what one request can cost.
        if len(body.tokens) > self.max_model_len:
            raise APIError(400, f"tokens: at most {self.max_model_len} (max_model_len), got {len(body.tokens)}",
                           param="tokens")
        if not all(0 <= t < len(tokenizer) for t in body.tokens):
            raise APIError(400, f"tokens: each must be in [0, {len(tokenizer)})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}
