"""jaxmtp: a JAX/XLA inference engine with MTP speculative decoding that stays exact
under chunked prefill."""

__version__ = "0.2.0"

from jaxmtp.api import LLM
from jaxmtp.engine import LLMEngine
from jaxmtp.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxmtp.sampling_params import SamplingParams
from jaxmtp.structured_outputs import StructuredOutputsParams

__all__ = [
    "__version__", "LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
    "StructuredOutputsParams",
]
