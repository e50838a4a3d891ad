"""EventOverlap: lets communication run on its own stream while the caller computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class EventOverlap:
    """A recorded CUDA event (or nothing, when the work already finished on the CPU).

    `current_stream_wait()` makes the caller's current stream wait for the communication; used as
    a context manager it does so on exit, so the block's compute overlaps with the transfer::

        recv, ..., event = buffer.dispatch(x, ..., async_finish=True)
        with event:
            other_compute()      # runs while dispatch is in flight
        use(recv)                # safe: the current stream waited on exit
    """

    def __init__(self, event: Any = None, extra_tensors: tuple[Any, ...] | None = None) -> None:
        self.event = event
        # Keeps tensors that the in-flight work reads or writes alive until the wait.
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Callable[[], Any] | None = None

    @classmethod
    def capture(cls, device: Any = None) -> EventOverlap:
        """An event recorded on the current stream of `device` (a completed one on the CPU)."""
        import torch

        if device is not None and torch.device(device).type != "cuda":
            return cls(None)
        if not torch.cuda.is_available():
            return cls(None)
        if torch.cuda.is_current_stream_capturing():
            return cls(None)  # inside a CUDA graph the graph's own order is the synchronization
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return cls(ev)

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the work (nothing to wait for on the CPU), run the hook
        registered with register_hook_after_wait, and with `release_handle` drop the event and the kept
        tensors (DeepEP's signature)."""
        if self.event is not None:
            import torch

            torch.cuda.current_stream().wait_event(self.event)
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None
            self.extra_tensors = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Run `hook_after_wait` (once) right after the next current_stream_wait()."""
        if self.hook_after_wait is not None:
            raise RuntimeError("register_hook_after_wait: a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def query(self) -> bool:
        """True when the recorded work has finished (always True on the CPU)."""
        return self.event is None or bool(self.event.query())

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """`with event(release_handle=True): ...` waits on exit and then releases the handle."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False
