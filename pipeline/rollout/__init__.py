"""Rollout engines: the ``RolloutEngine`` and ``WeightSink`` protocols, the in-process HF engine, the SGLang client.

Which engine a run uses is the rollout backends' table (``pipeline.rollout.backends``). Records,
the protocols and the mismatch metrics import eagerly; the engines import lazily
(``LocalEngine`` pulls in ``transformers``, ``SGLangEngine`` ``httpx``), so
``import pipeline.rollout`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.rollout.mismatch import logprob_mismatch
from pipeline.rollout.types import (
    Completion,
    FinishReason,
    GenerationRequest,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    WeightSink,
)

if TYPE_CHECKING:
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.sglang.client import SGLangClientConfig
    from pipeline.rollout.sglang.generation import SGLangEngine
    from pipeline.rollout.sglang.protocol import SGLangServerSpec

__all__ = [
    "Completion",
    "FinishReason",
    "GenerationRequest",
    "LocalEngine",
    "RolloutEngine",
    "RolloutError",
    "SGLangClientConfig",
    "SGLangEngine",
    "SGLangServerSpec",
    "SamplingParams",
    "WeightSink",
    "logprob_mismatch",
]

_LAZY = {
    "LocalEngine": "pipeline.rollout.local",
    "SGLangEngine": "pipeline.rollout.sglang.generation",
    "SGLangClientConfig": "pipeline.rollout.sglang.client",
    "SGLangServerSpec": "pipeline.rollout.sglang.protocol",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
