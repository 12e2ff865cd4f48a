"""scripts/demo_profile.py: a py-spy profile of the demo summed by step and innermost triclip function."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "scripts" / "demo_profile.py"
_spec = importlib.util.spec_from_file_location("demo_profile", _path)
demo_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_profile)
summarise = demo_profile.summarise


def test_samples_are_summed_by_demo_step_and_innermost_triclip_function():
    lines = [
        "run_demo (triclip/app/demo.py:60);_build (triclip/app/demo.py:84);_train (triclip/app/demo.py:90);"
        "run (/x/triclip/model/accel.py:332);numpy_op (numpy/core.py:1) 30\n",
        "run_demo (triclip/app/demo.py:60);_index (triclip/app/demo.py:110);fit (/x/triclip/codecs/rq.py:70) 5\n",
        "run_demo (triclip/app/demo.py:60);_index (triclip/app/demo.py:110);fit (/x/triclip/codecs/rq.py:71) 2\n",
        "thread (threading.py:1);_put (/x/triclip/model/prefetch.py:9) 4\n",
        "garbage\n",
    ]
    steps, functions = summarise(lines)
    assert steps == {"2 train (MRL, tricl)": 30, "4 index": 7, "other (worker threads, start-up)": 4}
    assert functions[("4 index", "fit (triclip/codecs/rq.py)")] == 7  # line numbers merged
    assert functions[("2 train (MRL, tricl)", "run (triclip/model/accel.py)")] == 30  # innermost triclip frame
