"""One engine, several threads: one call at a time, and a knob change between calls.

Every public call of an ``Engine`` (``embed``, ``score``, ``rerank``, ``encode``, ...) enters the gate as a *call*,
``configure`` as a *change*. Calls from several threads run one after another (each call already shares its steps
among every core through the CPU worker pool, so running two at once gains little; and on one 2-vCPU AMD EPYC three
threads embedding at once in bfloat16 got vectors up to 0.04 from the single-threaded ones in 2 of 15 runs, a race
below the engine not pinned down, which one call at a time rules out). A change waits until the call running in
another thread has finished, and goes before calls that arrive meanwhile, so a stream of calls cannot starve it. So a
call sees one setting from its start to its end (its knobs, its weights' dtype, its adapters, its CPU plan), and a
change never swaps weights under a running forward. Within one thread the gate is re-entrant: a call made inside a call
(``rerank`` building on ``embed_pass``) or inside a change runs at once.

An interrupt (Ctrl-C) inside a call or a change leaves the gate open: every entry is undone in a ``finally``, and
the gate's lock is re-entrant, so an interrupt landing between taking the lock and the ``with``'s exit (the window
CPython's line tracing opens there) cannot leave the thread waiting on a lock it holds itself: such a leaked hold is
given back when the thread next enters or leaves the gate. A waiting thread also re-checks, every ``POLL`` seconds,
whether the threads it waits for are still alive, so a thread that died inside a call cannot block the others
forever.

    >>> gate = Gate()
    >>> with gate.call(): ...          # embed, score, ... (one thread at a time)
    >>> with gate.change(): ...        # configure (alone)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

POLL = 0.5  # seconds between re-checks of the threads a waiter waits for


class Gate:
    def __init__(self):
        self._cond = threading.Condition(threading.RLock())
        self._calls: dict[int, int] = {}  # thread ident -> calls it is inside (nested calls counted)
        self._changer: int | None = None  # the thread inside a change
        self._depth = 0  # nested changes of that thread
        self._waiting: dict[int, int] = {}  # thread ident -> changes it waits to make (new calls let them in first)

    @contextmanager
    def call(self) -> Iterator[None]:
        """Run as a call: waits while another thread calls or changes the engine."""
        me = threading.get_ident()
        entered = False
        try:
            self._give_back_leaked_hold()
            with self._cond:
                while self._held_off(me):
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
                self._give_back_leaked_hold()

    @contextmanager
    def change(self) -> Iterator[None]:
        """Run as a change: waits for the calls of other threads (and another thread's change) to finish, and keeps
        new calls of other threads waiting until it is done."""
        me = threading.get_ident()
        entered = False
        try:
            self._give_back_leaked_hold()
            with self._cond:
                self._waiting[me] = self._waiting.get(me, 0) + 1
                try:
                    while self._busy(me):
                        self._cond.wait(POLL)
                finally:
                    self._waiting = {i: n for i, n in self._waiting.items() if i != me}
                self._changer, self._depth, entered = me, self._depth + 1, True  # one line: no interrupt between
            yield
        finally:
            if entered:
                with self._cond:
                    self._depth -= 1
                    if self._depth <= 0:
                        self._changer, self._depth = None, 0
                    self._cond.notify_all()
                self._give_back_leaked_hold()

    def _give_back_leaked_hold(self) -> None:
        """Release the lock where this thread still holds it outside the gate's own ``with`` blocks (the only place
        it may): an interrupt between taking it and the ``with``'s exit left it held."""
        while self._cond._is_owned():
            self._cond.release()

    def _held_off(self, me: int) -> bool:
        """Whether a new call of thread ``me`` waits: another live thread is inside a call, changes the engine, or
        waits to (a change goes first, so a stream of calls cannot starve it); never when ``me`` is inside a call
        already (a nested call must not wait for its own outer call)."""
        if me in self._calls:
            return False
        return (
            (self._changer not in (None, me) and _alive(self._changer))
            or any(i != me and _alive(i) for i in self._waiting)
            or any(i != me and _alive(i) for i in self._calls)
        )

    def _busy(self, me: int) -> bool:
        """Whether another live thread is inside a call or a change (entries of dead threads are dropped); two
        threads waiting to change go one at a time."""
        for ident in [i for i in self._calls if i != me and not _alive(i)]:
            del self._calls[ident]
        if self._changer not in (None, me) and not _alive(self._changer):
            self._changer, self._depth = None, 0
        return any(i != me for i in self._calls) or self._changer not in (None, me)


def _alive(ident: int) -> bool:
    return any(t.ident == ident for t in threading.enumerate())
