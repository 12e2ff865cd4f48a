"""``--fixed-logit-scale``: the logit scale is held at the given value (not trained) and recorded."""

from __future__ import annotations

import pytest

from triclip.app.cli import main
from triclip.core.errors import UserError
from triclip.training import checkpoint as ckpt
from triclip.training.train import TrainConfig, train


def _cfg(shapes_data, out, **kw) -> TrainConfig:
    base = dict(train_data=str(shapes_data / "train.jsonl"), out=str(out), model="tiny", embed_dim=16,
                loss="infonce", epochs=1, batch_size=32, max_steps=3, lr=0.1)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def test_a_fixed_scale_stays_put_and_is_recorded(shapes_data, tmp_path):
    train(_cfg(shapes_data, tmp_path / "fixed", fixed_logit_scale=10.0))
    model, config = ckpt.load_run(tmp_path / "fixed", which="last")
    assert float(model.logit_scale().detach()) == pytest.approx(10.0, rel=1e-6)
    assert config["train"]["fixed_logit_scale"] == 10.0
    train(_cfg(shapes_data, tmp_path / "learned"))  # the same run with the scale learned moves it (lr 0.1)
    learned, _ = ckpt.load_run(tmp_path / "learned", which="last")
    assert abs(float(learned.logit_scale().detach()) - 1 / 0.07) > 0.05


@pytest.mark.parametrize("bad", [0.5, 0.0, -3.0, 101.0, float("nan"), float("inf")])
def test_a_bad_value_is_a_user_error(shapes_data, tmp_path, bad):
    with pytest.raises(UserError, match="logit-scale"):
        train(_cfg(shapes_data, tmp_path / "run", fixed_logit_scale=bad))


def test_the_cli_refuses_a_bad_value_in_one_line(shapes_data, tmp_path, capsys):
    code = main(["train", "--train-data", str(shapes_data / "train.jsonl"), "--out", str(tmp_path / "run"),
                 "--model", "tiny", "--fixed-logit-scale", "200"])  # fmt: skip
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "--fixed-logit-scale" in err[0] and "Traceback" not in err[0]
