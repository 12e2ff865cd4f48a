"""triclip.core.memory: with the thresholds set, memory a process frees is reused without new page faults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from triclip.core.memory import keep_freed_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")

# Allocates and frees the same blocks ten times (100 KB: served from the heap, whose free top glibc gives back
# above 128 KB; 4 MB: each one mapped and unmapped by default); prints the minor page faults of each size.
CHURN = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from triclip.core.memory import keep_freed_memory
    assert keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for size in (100_000, 4_000_000):
    before = faults()
    for _ in range(10):
        blocks = [np.ones(size // 8) for _ in range(20_000_000 // size)]  # 20 MB in all
        del blocks
    print(faults() - before)
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True).stdout
    return [int(line) for line in out.split()]


@glibc
def test_freed_blocks_are_reused_without_faulting_them_in_again():
    default, kept = _faults("default"), _faults("keep")
    pages = 20_000_000 // 4096  # one round's pages: faulted in at least once either way
    assert default[0] > 5 * pages and default[1] > 5 * pages  # the default returns them and faults them in again
    assert kept[0] < 2 * pages and kept[1] < 2 * pages  # kept: the first round's faults, hardly more


@glibc
def test_it_says_whether_it_set_the_thresholds():
    assert keep_freed_memory() is True
