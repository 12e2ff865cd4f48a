"""``python -m benchmarks.rows_cold``: each draw gathered never read, cold (evicted again) and warm, every way, and
the rows the file's."""

from __future__ import annotations

import numpy as np

from benchmarks import rows_cold


def test_each_way_times_its_draws_three_times_and_gathers_the_files_rows(tmp_path, monkeypatch, capsys):
    x = np.random.default_rng(0).standard_normal((3000, 16)).astype(np.float32)
    np.save(tmp_path / "v.npy", x)
    gathered = []
    real = rows_cold.ways

    def checked(rows):  # every way, and whether it gathered the file's rows
        def wrap(gather):
            def run(ids):
                got = gather(ids)
                gathered.append(np.array_equal(got[-1] if isinstance(got, tuple) else got, x[ids]))
            return run
        return {way: wrap(gather) for way, gather in real(rows).items()}
    monkeypatch.setattr(rows_cold, "ways", checked)
    out = rows_cold.measure(str(tmp_path / "v.npy"), 40, reps=2, seed=3)
    assert set(out) == {"32 threads", "asked, 1 thread", "asked, 32 threads"}
    assert all(len(times) == 3 and all(len(t) == 2 and min(t) >= 0 for t in times) for times in out.values())
    assert len(gathered) == 3 * 3 * 2 and all(gathered)
    monkeypatch.setattr(rows_cold, "ways", real)
    rows_cold.main([str(tmp_path / "v.npy"), "--rows", "10,20", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "never read" in lines[1] and len(lines) == 2 + 2 * 3
    assert all(len(line.split()) >= 5 for line in lines[2:])
