"""The worker mailboxes on their own: delivery, ordering of put and take, abort."""
import threading
import time

import pytest

from ipukit.runtime.workers import Aborted, Exchange


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
