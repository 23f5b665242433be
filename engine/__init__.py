"""graphline engine: requests, continuous-batching schedulers (one per DP rank), the offline
`LLMEngine.generate` API and the streaming `AsyncLLMEngine`. See engine/README.md."""
from engine.async_engine import AsyncLLMEngine, EngineFailedError, EngineObserver, RequestStream
from engine.executor import Executor, LocalEngineExecutor
from engine.llm_engine import EngineConfig, EngineStepError, LLMEngine, StepInfo
from engine.errors import RequestError
from engine.request import FinishReason, ModelLimits, Request, RequestOutput, validate_request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerError
from engine.sequence import Sequence, SeqStatus

__all__ = [
    "AsyncLLMEngine", "EngineFailedError", "EngineObserver", "RequestStream", "Executor", "LocalEngineExecutor",
    "EngineConfig", "EngineStepError", "LLMEngine", "StepInfo", "FinishReason", "ModelLimits", "Request",
    "RequestError", "RequestOutput", "validate_request", "Scheduler", "SchedulerConfig", "SchedulerError",
    "Sequence", "SeqStatus", "SamplingParams",
]
