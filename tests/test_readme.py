"""The README stays a guide: at most 250 lines, and its first two commands are the whole set-up."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_starts_with_the_demo_and_the_tests():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250  # full tables live in docs/
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()  # CI runs exactly the README's test command


def test_the_readmes_recipe_is_the_demos():
    """The six commands under "Your own data" train the steps triclip.training.config defines (MRL_STEP, TUNE_STEP)."""
    from triclip.losses import build_loss
    from triclip.training.config import MRL_STEP, TUNE_STEP, TrainConfig

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Your own data.*?```bash\n(.*?)```", text, re.S).group(1)
    trains = [line.split("#")[0].split() for line in block.splitlines() if " train " in line]
    assert len(trains) == 2
    first, tune = (dict(zip(words, words[1:])) for words in trains)  # flag -> the word after it
    assert first.get("--loss", TrainConfig(train_data="", out="").loss) == MRL_STEP["loss"]
    assert "--init" in tune and tune["--loss"] == TUNE_STEP["loss"]
    assert repr(build_loss(tune["--loss"])) == repr(build_loss(TUNE_STEP["loss"], **TUNE_STEP["loss_options"]))
    assert int(tune["--epochs"]) == TUNE_STEP["epochs"] and float(tune["--lr"]) == TUNE_STEP["lr"]
    assert {k for k in tune if k.startswith("--")} <= {"--model", "--init", "--loss", "--epochs", "--lr", "--out"}
