"""minivllm: an LLM inference engine built chapter by chapter."""
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
