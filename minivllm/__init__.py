"""minivllm: an LLM inference engine built chapter by chapter."""
import os as _os

if _os.environ.get("MINIVLLM_LEARNER", "").strip() not in ("", "0"):
    # The course's switch, first of all: every exercise module imported from here on comes
    # from the learner's copy (exercises/minivllm/, up to a chapter) or the reference (solutions/minivllm/).
    from minivllm import learner as _learner

    _learner.install(*_learner.parse(_os.environ["MINIVLLM_LEARNER"]))
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.structured import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
