"""A user's step for one micro-batch, run once: paused at its network call, continued with the
network's output.

Under a pipeline the network's output for a micro-batch exists only later, on the last stage, while
the code the step runs before its network call (masking, counters, logging) must run once per
micro-batch on every rank, as gradient accumulation runs it, and what it computed must be what the
loss sees. So each micro-batch's step runs in a thread of its own: `start()` runs it until it calls
the network and hands back the call's arguments; `resume(output)` lets the call return `output` and
runs the rest of the step (the loss); `abandon()` ends a step whose loss this rank does not compute
(the network call raises `Abandoned`, which `except Exception` does not catch). Only one thread
runs at a time: the caller waits for the step to pause or end, so the step's code runs as if
inline, in micro-batch order.

Torch's per-thread settings (grad mode, inference mode, autocast, the current device) are the
caller's; the random generators are process-wide, so the draws happen in micro-batch order.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Abandoned", "Continuation", "Event"]


class Abandoned(BaseException):
    """Raised at the network call of a step whose loss this rank does not compute."""


@dataclass
class Event:
    """Where a step stopped: "call" (at its network call, with its arguments), "return" (with
    its result) or "raise" (with the exception it raised)."""

    kind: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None
    value: Any = None


class Continuation:
    """`step(network)` in a thread: `network(*args, **kwargs)` pauses it (see the module
    docstring). One network call per step; a second raises `ValueError` inside the step."""

    def __init__(self, step: Callable[[Callable[..., Any]], Any], second_call: str) -> None:
        self._step, self._second_call = step, second_call
        self._to_step: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
        self._to_caller: queue.Queue[Event] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._calls = 0
        self.done = False

    def start(self) -> Event:
        settings = _ThreadSettings()
        self._thread = threading.Thread(target=self._run, args=(settings,), daemon=True)
        self._thread.start()
        return self._wait()

    def resume(self, output: Any) -> Event:
        """The network call returns `output`; the step runs on to its end (or a second call)."""
        self._to_step.put(("output", output))
        return self._wait()

    def abandon(self) -> None:
        """End a step paused at its network call (its rest never runs)."""
        if self._thread is not None and not self.done:
            self._to_step.put(("abandon", None))
            self._thread.join()
            self.done = True

    def _wait(self) -> Event:
        event = self._to_caller.get()
        self.done = event.kind != "call"
        if self.done and self._thread is not None:
            self._thread.join()
        return event

    def _network(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        if self._calls > 1:
            raise ValueError(self._second_call)
        self._to_caller.put(Event("call", args, kwargs))
        what, value = self._to_step.get()
        if what == "abandon":
            raise Abandoned
        return value

    def _run(self, settings: _ThreadSettings) -> None:
        try:
            with settings.applied():
                value = self._step(self._network)
        except Abandoned:
            self._to_caller.put(Event("return"))
            return
        except BaseException as err:  # handed to the caller, who raises it
            self._to_caller.put(Event("raise", value=err))
            return
        self._to_caller.put(Event("return", value=value))


class _ThreadSettings:
    """The calling thread's per-thread torch settings, to apply in the step's thread."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = {
            kind: torch.get_autocast_dtype(kind)
            for kind in ("cpu", "cuda")
            if torch.is_autocast_enabled(kind)
        }
        self.device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        if self.device is not None:
            torch.cuda.set_device(self.device)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, dtype in self.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield
