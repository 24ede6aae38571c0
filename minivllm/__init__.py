"""minivllm: an LLM inference engine built chapter by chapter."""
__version__ = "0.1.0"
