"""app/gc_pauses.py: start-up objects frozen out of the collector's walks, and each collection timed."""

from __future__ import annotations

import gc

from app import gc_pauses
from app.metrics import Metrics


def test_settle_freezes_what_start_up_left_and_collects_its_garbage():
    class Cycle:
        pass

    a = Cycle()
    a.self = a  # start-up garbage: a cycle nobody holds
    ref = id(a)
    del a
    try:
        frozen = gc_pauses.settle("test")
        assert frozen == gc.get_freeze_count() > 1000  # pytest, prometheus_client... all frozen
        assert all(id(o) != ref for o in gc.get_objects())  # the cycle was collected, not frozen
        assert len(gc.get_objects()) < frozen  # a full collection walks only what came after
    finally:
        gc.unfreeze()


def test_pause_timer_hands_each_collection_to_the_metric_once():
    m = Metrics(model_name="t")
    timer = gc_pauses.PauseTimer(m.collected)
    try:
        gc.collect(2)
        gc.collect(0)
        assert timer.drain() >= 2 and timer.drain() == 0
    finally:
        timer.close()
    assert timer._callback not in gc.callbacks
    counts = {}
    for line in m.render()[0].decode().splitlines():
        if line.startswith("remask:gc_pause_seconds_count{"):
            counts[line.split('generation="')[1][0]] = float(line.split()[-1])
    assert counts["2"] >= 1 and counts["0"] >= 1 and "1" in counts  # every generation's series exists
