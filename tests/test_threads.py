"""One engine, several threads (``lab.engine.gate``): ``configure`` while other threads embed leaves every call
with one setting from start to end, and the gate's rules hold on their own."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lab import Engine
from lab.engine.gate import Gate


def test_configure_while_other_threads_embed(minilm_path, sentences):
    """Three threads embed in a loop while the main thread switches the dtype back and forth: no call fails, and
    every result is the float32 or the bfloat16 result (never a mix of the two settings)."""
    eng = Engine(minilm_path)
    texts = sentences[:48]
    ref = {"float32": eng.embed(texts)}
    eng.configure(dtype="bfloat16")
    ref["bfloat16"] = eng.embed(texts)
    eng.configure(dtype="float32")
    assert np.abs(ref["float32"] - ref["bfloat16"]).max() > 1e-3  # the two settings are told apart below
    results, errors, stop = [], [], threading.Event()

    def work():
        try:
            while not stop.is_set():
                results.append(eng.embed(texts))
        except Exception as e:  # noqa: BLE001 (surfaced below)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for dtype in ["bfloat16", "float32"] * 3:
        time.sleep(0.05)
        eng.configure(dtype=dtype)
        assert eng.resolved["dtype"] == dtype
    stop.set()
    for t in threads:
        t.join()
    assert errors == [] and len(results) >= 3
    for got in results:
        assert min(np.abs(got - r).max() for r in ref.values()) < 2e-5


def test_a_change_waits_for_calls_and_calls_wait_for_a_change():
    gate, log = Gate(), []
    in_call, release, in_change = threading.Event(), threading.Event(), threading.Event()

    def call():
        with gate.call():
            log.append("call in")
            in_call.set()
            release.wait(5)
            log.append("call out")

    def change():
        with gate.change():
            log.append("change")
            in_change.set()
            time.sleep(0.1)
            log.append("change out")

    def late_call():
        with gate.call():
            log.append("late call")

    first = threading.Thread(target=call)
    first.start()
    in_call.wait(5)
    changer = threading.Thread(target=change)
    changer.start()
    time.sleep(0.1)
    assert log == ["call in"]  # the change waits for the running call
    release.set()
    in_change.wait(5)
    late = threading.Thread(target=late_call)
    late.start()
    for t in (first, changer, late):
        t.join()
    assert log == ["call in", "call out", "change", "change out", "late call"]  # the late call waited for it


def test_the_gate_is_reentrant_and_forgets_dead_threads():
    gate = Gate()
    with gate.change(), gate.call(), gate.change():  # nested in one thread: no wait
        pass
    with gate.call(), gate.call():
        pass

    def die_inside():
        gate.call().__enter__()  # never left: the thread ends inside a call

    t = threading.Thread(target=die_inside)
    t.start()
    t.join()
    done = threading.Event()
    threading.Thread(target=lambda: (gate.change().__enter__(), done.set())).start()
    assert done.wait(5)  # the dead thread's call does not block a change forever


def test_an_interrupted_call_leaves_the_gate_open():
    gate = Gate()
    with pytest.raises(KeyboardInterrupt), gate.call():
        raise KeyboardInterrupt
    done = threading.Event()
    threading.Thread(target=lambda: (gate.change().__enter__(), done.set())).start()
    assert done.wait(2)


def test_calls_of_several_threads_run_one_at_a_time():
    gate, inside, most = Gate(), [0], [0]
    lock = threading.Lock()

    def call():
        for _ in range(5):
            with gate.call():
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                with gate.call():  # nested in one thread: runs at once
                    time.sleep(0.005)
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and inside[0] == 0
