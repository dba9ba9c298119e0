"""pdserve: an LLM inference server with prefill/decode disaggregation."""

from pdserve.llm import LLM
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
