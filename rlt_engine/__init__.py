"""The rlt engine process: scheduler, KV manager, RngRegistry, executors, offline API."""

from protocol.messages import SamplingParams
from rlt_engine.config import EngineConfig
from rlt_engine.engine import LLMEngine
from rlt_engine.errors import CapacityError, InvalidRequestError
from rlt_engine.llm import LLM
from rlt_engine.output_processor import GenerationOutput

__all__ = [
    "LLM", "CapacityError", "EngineConfig", "GenerationOutput", "InvalidRequestError", "LLMEngine", "SamplingParams",
]
