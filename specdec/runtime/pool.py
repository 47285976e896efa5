"""How an Engine lends its runners to a request: a :class:`Lease`, and the pools that hand them out.

``Engine.stream`` asks its pool for a lease when a request's first step is asked for and gives it back
when the steps end or are closed.  A lease holds what the request decodes with: the target runner, the
draft model's runner (or None) and the controller factory (k as given -> a fixed k or a Controller).

- :class:`SinglePool` (the default) lends the engine's own runners to one request at a time; a request
  from another thread waits for the one running to end.
- ``specdec.runtime.batching.BatchPool`` (``Engine.enable_batching``) lends each request a slot of a batch:
  a target runner whose forwards are packed with the other slots', a draft runner of its own and a
  controller that sees the batch's load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from specdec.errors import SpecdecError

if TYPE_CHECKING:
    from specdec.algorithm.control import Controller
    from specdec.algorithm.sampling import SamplingParams
    from specdec.backends.base import Footprint, ModelRunner
    from specdec.request import RequestConfig


@dataclass(frozen=True)
class Lease:
    """The runners one request decodes with, and how its k becomes a controller."""

    target: ModelRunner
    draft: ModelRunner | None
    controller: Callable[[int | str | Controller, SamplingParams], int | Controller]


class RunnerPool(Protocol):
    """Lends an engine's runners to requests (see the module doc)."""

    @property
    def max_batch(self) -> int:
        """Requests decoded at once."""
        ...

    def check(self, config: RequestConfig) -> None:
        """A SpecdecError for a request this pool cannot run."""

    def lease(self, config: RequestConfig) -> AbstractContextManager[Lease]:
        """The request's lease, held until the block ends."""

    def footprints(self) -> tuple[Footprint, Footprint | None]:
        """The footprints of the target runner and the draft runner (None: none) a lease gives: what a request's
        memory is priced by (specdec.runtime.memory.request_need)."""


class SinglePool:
    """One lease (an engine's own runners and controllers), lent to one request at a time."""

    max_batch = 1

    def __init__(self, lease: Lease) -> None:
        self._lease = lease
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread whose request holds the runners

    def check(self, config: RequestConfig) -> None:
        """Any request runs on the engine's own runners."""

    def footprints(self) -> tuple[Footprint, Footprint | None]:
        draft = self._lease.draft
        return self._lease.target.footprint(), draft.footprint() if draft is not None else None

    @contextmanager
    def lease(self, config: RequestConfig) -> Iterator[Lease]:
        if self._holder == threading.get_ident():  # waiting would wait for itself
            raise SpecdecError("this thread is already decoding a request with this engine: run its steps to "
                               "the end or close them before starting another")
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield self._lease
            finally:
                self._holder = None
