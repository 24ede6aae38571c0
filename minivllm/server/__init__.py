"""Serving: an async loop around the engine, and an OpenAI-compatible HTTP API on it."""
from minivllm.server.async_engine import AsyncLLMEngine, EngineDeadError

__all__ = ["AsyncLLMEngine", "EngineDeadError"]
