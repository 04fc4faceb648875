"""One engine, several threads: calls run together, a knob change runs alone.

Every public call of an ``Engine`` (``embed``, ``score``, ``rerank``, ``encode``, ...) enters the gate as a *call*,
``configure`` as a *change*. Calls from any number of threads run at once; a change waits until the calls running
in other threads have finished, and calls that arrive meanwhile wait until it is done. So a call sees one setting
from its start to its end (its knobs, its weights' dtype, its adapters, its CPU plan), and a change never swaps
weights under a running forward. Within one thread the gate is re-entrant: a call made inside a call (``rerank``
building on ``embed_pass``) or inside a change runs at once.

An interrupt (Ctrl-C) inside a call or a change leaves the gate open: every entry is undone in a ``finally``. A
waiting thread also re-checks, every ``POLL`` seconds, whether the threads it waits for are still alive, so a thread
that died inside a call cannot block the others forever.

    >>> gate = Gate()
    >>> with gate.call(): ...          # embed, score, ... (many threads at once)
    >>> with gate.change(): ...        # configure (alone)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

POLL = 0.5  # seconds between re-checks of the threads a waiter waits for


class Gate:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._calls: dict[int, int] = {}  # thread ident -> calls it is inside (nested calls counted)
        self._changer: int | None = None  # the thread inside a change
        self._depth = 0  # nested changes of that thread

    @contextmanager
    def call(self) -> Iterator[None]:
        """Run as a call: waits while another thread changes the engine."""
        me = threading.get_ident()
        entered = False
        try:
            with self._cond:
                while self._changer not in (None, me) and _alive(self._changer):
                    self._cond.wait(POLL)
                if self._changer is not None and self._changer != me:  # its thread died inside the change
                    self._changer, self._depth = None, 0
                self._calls[me], entered = self._calls.get(me, 0) + 1, True  # one line: no interrupt between
            yield
        finally:
            if entered:
                with self._cond:
                    left = self._calls.get(me, 1) - 1
                    if left:
                        self._calls[me] = left
                    else:
                        self._calls.pop(me, None)
                    self._cond.notify_all()

    @contextmanager
    def change(self) -> Iterator[None]:
        """Run as a change: waits for the calls of other threads (and another thread's change) to finish, and keeps
        new calls of other threads waiting until it is done."""
        me = threading.get_ident()
        entered = False
        try:
            with self._cond:
                while self._busy(me):
                    self._cond.wait(POLL)
                self._changer, self._depth, entered = me, self._depth + 1, True  # one line: no interrupt between
            yield
        finally:
            if entered:
                with self._cond:
                    self._depth -= 1
                    if self._depth <= 0:
                        self._changer, self._depth = None, 0
                    self._cond.notify_all()

    def _busy(self, me: int) -> bool:
        """Whether another live thread is inside a call or a change (entries of dead threads are dropped)."""
        for ident in [i for i in self._calls if i != me and not _alive(i)]:
            del self._calls[ident]
        if self._changer not in (None, me) and not _alive(self._changer):
            self._changer, self._depth = None, 0
        return any(i != me for i in self._calls) or self._changer not in (None, me)


def _alive(ident: int) -> bool:
    return any(t.ident == ident for t in threading.enumerate())
