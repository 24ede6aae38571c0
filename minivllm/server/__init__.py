"""Serving: an async loop around the engine, and an OpenAI-compatible API on it; the engine
in a thread of the server's process (AsyncLLMEngine) or in a process of its own
(EngineCoreClient)."""
from minivllm.server.async_engine import AsyncLLMEngine, EngineDeadError
from minivllm.server.engine_client import EngineCoreClient

__all__ = ["AsyncLLMEngine", "EngineCoreClient", "EngineDeadError"]
