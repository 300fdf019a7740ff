"""Transports: symmetric memory with one-sided get / accumulate (see :mod:`odc_runtime.transport.base`)."""

from odc_runtime.transport.base import (
    AccumulateRequest,
    CompletedWork,
    GetRequest,
    SymmetricBuffer,
    Transport,
    Work,
)

__all__ = ["AccumulateRequest", "CompletedWork", "GetRequest", "SymmetricBuffer", "Transport", "Work"]
