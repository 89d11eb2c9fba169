"""Rollout engines: the ``RolloutEngine`` protocol, the in-process HF engine, the SGLang client.

Records, the protocol and the mismatch metrics import eagerly; the engines import
lazily (``LocalEngine`` pulls in ``transformers``, ``SGLangEngine`` ``httpx``), so
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
)

if TYPE_CHECKING:
    from pipeline.rollout.local import LocalEngine
    from pipeline.rollout.sglang_api import SGLangServerSpec
    from pipeline.rollout.sglang_engine import SGLangClientConfig, SGLangEngine

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
    "logprob_mismatch",
]

_LAZY = {
    "LocalEngine": "pipeline.rollout.local",
    "SGLangEngine": "pipeline.rollout.sglang_engine",
    "SGLangClientConfig": "pipeline.rollout.sglang_engine",
    "SGLangServerSpec": "pipeline.rollout.sglang_api",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
