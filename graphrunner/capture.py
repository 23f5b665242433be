"""Capture helpers shared by full decode graphs and piecewise plans.

A failed capture must leave the process usable and must never replace the
exception that caused it. `torch.cuda.graph.__exit__` calls `capture_end()`
unconditionally, which raises again on an invalidated capture, and in that case
torch has not yet ended the caching allocator's routing to the graph pool nor
released the pool's use count (`cudaStreamEndCapture` fails first). These helpers
end captures best-effort, undo what torch skipped, and keep the original error.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def release_failed_capture(graph: Any, device: torch.device) -> None:
    """After `capture_end()` raised: end the allocator's routing to the capture's pool and drop the
    capture's use count (private torch APIs, looked up defensively across versions). Never raises.
    The pool id must not be used for another capture afterwards."""
    try:
        pool = graph.pool()
        index = _device_index(device)
    except BaseException:  # noqa: BLE001
        return
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            try:
                fn(index, pool)
            except BaseException:  # noqa: BLE001 - routing already ended
                pass
            break
    release = getattr(torch._C, "_cuda_releasePool", None)
    if release is not None:
        try:
            release(index, pool)
        except BaseException:  # noqa: BLE001
            pass


def end_capture(graph: Any, device: torch.device, allow_empty: bool = False) -> None:
    """`graph.capture_end()`; on failure release the allocator state torch skipped, then re-raise.

    allow_empty: silence torch's warning for empty pieces (two adjacent eager boundaries).
    """
    try:
        if allow_empty:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=EMPTY_GRAPH_WARNING)
                graph.capture_end()
        else:
            graph.capture_end()
    except BaseException:
        release_failed_capture(graph, device)
        raise


def end_capture_quietly(graph: Any, device: torch.device) -> None:
    """Best-effort end of an abandoned capture (an exception is already propagating). Never raises."""
    try:
        end_capture(graph, device, allow_empty=True)
    except BaseException:  # noqa: BLE001 - the caller re-raises the original exception
        pass


class KeepOriginalErrorGraph(torch.cuda.graph):
    """`torch.cuda.graph(...)` that keeps the ORIGINAL exception of a failed capture.

    Same arguments as `torch.cuda.graph`. On success: capture_end, restore the stream.
    On an exception in the block: end the capture best-effort, restore the stream, and
    let the block's exception propagate unchanged. If capture_end itself fails after a
    clean block (invalidated capture), the allocator state is released and that error raised.
    """

    def __exit__(self, exc_type, exc, tb):  # type: ignore[override]
        device = torch.device("cuda", torch.cuda.current_device())
        if exc_type is None:
            try:
                end_capture(self.cuda_graph, device)
            except BaseException:
                self._restore_stream()
                raise
            self.stream_ctx.__exit__(None, None, None)
            return False
        end_capture_quietly(self.cuda_graph, device)
        self._restore_stream()
        return False

    def _restore_stream(self) -> None:
        try:
            self.stream_ctx.__exit__(None, None, None)
        except BaseException:  # noqa: BLE001
            pass
