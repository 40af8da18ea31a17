"""The worker mailboxes on their own: delivery, ordering of put and take, abort."""
import threading
import time

import pytest

from ipukit.workers import Aborted, Exchange


def test_put_before_take_and_take_before_put_both_deliver():
    ex = Exchange()
    ex.put("a", 1)
    assert ex.take("a") == 1
    got = []
    t = threading.Thread(target=lambda: got.append(ex.take("b")))
    t.start()
    time.sleep(0.05)
    assert got == []  # still waiting
    ex.put("b", 2)
    t.join(timeout=5)
    assert got == [2]


def test_abort_wakes_every_waiter_and_later_takes_fail_at_once():
    ex = Exchange()
    errors = []

    def wait(key):
        try:
            ex.take(key)
        except Aborted:
            errors.append(key)

    waiters = [threading.Thread(target=wait, args=(k,)) for k in "xyz"]
    for t in waiters:
        t.start()
    time.sleep(0.05)
    ex.abort()
    for t in waiters:
        t.join(timeout=5)
    assert sorted(errors) == ["x", "y", "z"]
    with pytest.raises(Aborted):
        ex.take("new")
    ex.put("late", 1)  # a put after an abort neither blocks nor raises


def test_a_message_is_taken_once():
    ex = Exchange()
    ex.put("k", 1)
    assert ex.take("k") == 1
    ex.put("k", 2)  # the same key again: a new message (the next iteration's, say)
    assert ex.take("k") == 2


# -- CoreGate: at most `cores` actions compute at once -------------------------------------------

def test_core_gate_lets_at_most_its_cores_in_at_once():
    from ipukit.workers import CoreGate

    gate, lock, inside, most = CoreGate(2), threading.Lock(), [0], [0]

    def work():
        for _ in range(20):
            gate.enter()
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.001)
            with lock:
                inside[0] -= 1
            gate.leave()

    threads = [threading.Thread(target=work) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert most[0] == 2  # filled, never exceeded


def test_core_gate_leave_without_enter_gives_nothing_back():
    """Error paths call ``leave`` whether or not the action held a core: it must not
    hand out a core nobody returned."""
    from ipukit.workers import CoreGate

    gate = CoreGate(1)
    gate.leave()  # holds nothing: a no-op
    gate.enter()
    gate.enter()  # the same thread again: still one core, no self-deadlock
    got = []
    other = threading.Thread(target=lambda: (gate.enter(), got.append(1), gate.leave()))
    other.start()
    other.join(0.2)
    assert got == []  # the only core is held
    gate.leave()
    other.join(5)
    assert got == [1]
    with pytest.raises(ValueError, match="at least one core"):
        CoreGate(0)
