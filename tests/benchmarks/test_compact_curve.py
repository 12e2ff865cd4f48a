"""The compact-curve report: goal checks against their definitions, table rows, the PNG."""

from PIL import Image

from benchmarks.compact_curve import curves, default_dims, goal_checks, markdown, plot


def _result(full: float, **orderings: dict) -> dict:
    compact = {o: {str(m): v for m, v in curve.items()} for o, curve in orderings.items()}  # JSON keys
    return {"t2i_r10": full, "compact": compact}


TRICL = _result(
    0.60,
    importance={4: 0.50, 8: 0.55},
    first={4: 0.30, 8: 0.40},
    random={4: 0.20, 8: 0.35},
    pca={4: 0.45, 8: 0.56},
)
INFONCE = _result(
    0.62,
    importance={4: 0.30, 8: 0.45},
    first={4: 0.30, 8: 0.45},
    random={4: 0.41, 8: 0.44},
    pca={4: 0.50, 8: 0.54},
)


def test_goal_checks_follow_the_issue_s_three_goals():
    checks = {statement: met for statement, met, _ in goal_checks(TRICL, INFONCE, dim=64)}
    assert checks == {
        "importance m=8 keeps >= 90% of full": 0.55 >= 0.9 * 0.60,  # True
        "importance m=4 >= infonce first + 0.10": True,  # 0.50 vs 0.30
        "importance m=4 >= infonce random + 0.10": False,  # 0.50 vs 0.41
        "importance m=8 >= infonce pca": True,  # 0.55 vs 0.54
        "importance m=4 >= infonce pca": True,  # 0.50 vs 0.50
    }


def test_curves_end_at_the_full_recall_and_the_table_has_a_row_per_run_and_ordering():
    dims = [4, 8, 64]
    assert default_dims(64) == [2, 4, 8, 16, 32, 64]
    assert curves(TRICL, dims)["importance"] == [0.50, 0.55, 0.60]
    rows = markdown({"tricl": TRICL, "infonce": INFONCE}, dims).splitlines()
    assert len(rows) == 2 + 2 * 4
    assert "| tricl | importance | 0.500 | 0.550 | 0.600 |" in rows


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "curve.png"
    plot({"tricl": TRICL, "infonce": INFONCE}, [4, 8, 64], str(path), "test")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 300
    assert [p.name for p in tmp_path.iterdir()] == ["curve.png"]  # no temp file left
