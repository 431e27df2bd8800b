"""`SlotCopies`: how a slot write is ordered against the compute stream on CUDA.

A prefetch writes an adapter's rows on a side stream, after everything the compute stream has
queued so far (the rows' last readers: the batch of the step that released them), so the step
that admits its request does not wait for the host-to-device copy on the host; the compute
stream waits for the copy's event only when the slot is held (or its rows are freed again). Every
write from host memory is fenced: ``on_host_copies`` is told of an event after its copies, so no
page-locked piece is reused while a copy may still read it. On CPU writes are synchronous and
none of this applies. Not thread-safe on its own: the model manager serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["SlotCopies"]


class SlotCopies:
    """The side stream (created here, at engine start, never while a graph is captured) and the
    copies pending on it, by handle id.

    :param on_host_copies: told of an event after each write's copies from host memory.
    """

    def __init__(self, device: torch.device,
                 on_host_copies: Callable[[torch.cuda.Event], None] | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.on_host_copies = on_host_copies
        self._pending: dict[int, torch.cuda.Event] = {}  # handle id -> its side-stream copy

    def write_aside(self, handle_id: int, write: Callable[[], None]) -> None:
        """Run ``write`` on the side stream, after the compute stream's work queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            write()
        self._pending[handle_id] = self._fence(self.stream)

    def written_in_line(self) -> None:
        """A write on the compute stream was queued: fence its copies from host memory."""
        if self.device.type == "cuda" and self.on_host_copies is not None:
            self._fence(torch.cuda.current_stream(self.device))

    def _fence(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event after the copies queued on ``stream``, told to `on_host_copies` while the
        caller still holds the adapter copied from (its host memory is not released before)."""
        event = torch.cuda.Event()
        event.record(stream)
        if self.on_host_copies is not None:
            self.on_host_copies(event)
        return event

    def wait(self, handle_id: int) -> None:
        """Make the compute stream wait for ``handle_id``'s side-stream copy, if one is pending."""
        event = self._pending.pop(handle_id, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
