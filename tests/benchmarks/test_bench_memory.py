"""bench_memory's stages: anonymous memory a stage allocates is seen in that stage, not in the next."""

from __future__ import annotations

import threading
import time

import numpy as np

from benchmarks.bench_memory import MIB, Stages


def test_a_stage_that_holds_memory_is_the_stage_that_shows_it():
    stages = Stages(0.01, traced=False)
    sampler = threading.Thread(target=stages.run, daemon=True)
    sampler.start()
    with stages.stage("small"):
        time.sleep(0.05)
    with stages.stage("big"):
        held = np.ones(200 * MIB // 8)  # 200 MiB, every page written
        time.sleep(0.05)
        del held
    with stages.stage("small"):
        time.sleep(0.05)
    stages.stopped.set()
    sampler.join()
    peaks = stages.peaks
    assert set(peaks) >= {"small", "big", "small#2"}
    assert peaks["big"]["anon_peak"] - peaks["small"]["anon_peak"] > 150 * MIB
    assert peaks["small#2"]["anon_peak"] < peaks["big"]["anon_peak"] - 150 * MIB  # freed: not carried over
    assert peaks["big"]["rss_peak"] >= peaks["big"]["anon_peak"]
