"""The serving roles' stop: SIGTERM, SIGINT or a thread's ``set`` always ends ``wait``.

Each case runs in a child process: ``StopRequest`` takes over the process's SIGTERM, SIGINT
and wakeup fd."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_child(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_signal_at_any_moment_around_the_wait_ends_it():
    # Signals at random moments around the wait, with busy threads contending for the GIL:
    # with a threading.Event set by a handler in place of the wakeup fd, this hangs within a
    # few dozen rounds.
    out = run_child("""
        import faulthandler, os, random, signal, threading
        from xcls.stop_request import StopRequest

        faulthandler.dump_traceback_later(60, exit=True)  # a lost signal: exit 1, the stacks
        def busy():
            while True:
                sum(range(1000))
        for _ in range(2):
            threading.Thread(target=busy, daemon=True).start()
        for round in range(200):
            stop = StopRequest()
            sig = signal.SIGTERM if round % 2 else signal.SIGINT
            timer = threading.Timer(random.random() * 0.0005, os.kill, (os.getpid(), sig))
            timer.start()
            stop.wait()
            timer.join()
        print("rounds", round + 1)
    """)
    assert out.split() == ["rounds", "200"]


def test_set_from_another_thread_ends_the_wait_and_other_signals_do_not():
    out = run_child("""
        import os, signal, threading, time
        from xcls.stop_request import StopRequest

        stop = StopRequest()
        handled = []
        signal.signal(signal.SIGUSR1, lambda *_: handled.append(1))
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs before the next line
        start = time.monotonic()
        print("after SIGUSR1", handled, stop.wait(0.2), time.monotonic() - start >= 0.2)
        threading.Timer(0.05, stop.set).start()
        start = time.monotonic()
        print("set", stop.wait(), time.monotonic() - start < 10, stop.signum)
        os.kill(os.getpid(), signal.SIGTERM)  # a signal after the word changes nothing
        print("again", stop.wait(0), stop.is_set(), stop.signum)
    """)
    assert out.splitlines() == ["after SIGUSR1 [1] False True", "set True True 0",
                                "again True True 0"]


def test_the_signal_that_asked_is_named_once_and_kept():
    out = run_child("""
        import logging, os, signal, sys
        from xcls.stop_request import StopRequest

        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        stop = StopRequest()
        print("before", stop.is_set(), stop.signum)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        print("after", stop.wait(5), stop.signum)
        stop.set()
        print("then", stop.is_set(), stop.signum)
    """)
    assert out.splitlines() == ["before False 0", "stop_requested signal=SIGINT",
                                "after True 2", "then True 2"]


def test_a_process_with_more_descriptors_than_select_takes_still_stops():
    out = run_child("""
        import os, resource, signal
        from xcls.stop_request import StopRequest

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 1500
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
        held = [os.dup(0) for _ in range(1200)]  # a shard's tables and connections
        stop = StopRequest()
        os.kill(os.getpid(), signal.SIGTERM)
        print(stop.wait(5), stop.signum)
    """)
    assert out.split() == ["True", "15"]
