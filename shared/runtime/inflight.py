"""The c10d calls this process's helper threads have in flight, waited for at its exit.

CPython ends a daemon thread that takes the GIL back once the interpreter finalizes. One
coming back from a c10d call is ended inside c10d's C++ frames, whose unwinding aborts
the process ("terminate called without an active exception"): a run that ended well
would exit with SIGABRT. So the store's helper threads (spare connects, operations a
caller left, a replica's watch) make each c10d call `inside()`, and at exit the
interpreter waits for the calls in flight, up to EXIT_WAIT_S, before it finalizes; no
call starts after that.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Longest wait at exit for the calls in flight (a connect that waits on the resolver
#: takes 5 s; one to a server that went fails within its connect timeout).
EXIT_WAIT_S = 10.0


class Exiting(RuntimeError):
    """The process is exiting: no c10d call starts on a helper thread any more."""


_cond = threading.Condition()
_inside = 0
_exiting = False


@contextmanager
def inside() -> Iterator[None]:
    """Marks a helper thread's c10d call; raises Exiting once the process exits."""
    global _inside
    with _cond:
        if _exiting:
            raise Exiting("the process is exiting")
        _inside += 1
    try:
        yield
    finally:
        with _cond:
            _inside -= 1
            _cond.notify_all()


def in_flight() -> int:
    """Helper threads' c10d calls in flight now."""
    with _cond:
        return _inside


def wait_at_exit(timeout_s: float = EXIT_WAIT_S) -> bool:
    """Starts no more calls and waits for those in flight; False when some outlasted
    `timeout_s`. Run by the interpreter at exit, before it ends daemon threads."""
    global _exiting
    with _cond:
        _exiting = True
        return _cond.wait_for(lambda: _inside == 0, timeout_s)


def _after_fork() -> None:
    """A forked child has none of its parent's threads, nor their calls."""
    global _cond, _inside
    _cond, _inside = threading.Condition(), 0


os.register_at_fork(after_in_child=_after_fork)
# Runs before the interpreter joins its threads, while every module still works.
threading._register_atexit(wait_at_exit)  # type: ignore[attr-defined]
