"""App API robustness, against a real server and the real ``triclip app`` command.

``m`` and ``k`` as numbers or numeric strings on every endpoint; malformed payloads get
a message (not ``{"error": null}``) and no server traceback; a bad or busy port is one
line before anything loads; SIGTERM stops the app cleanly, with no ``nanobind: leaked``
lines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from gradio_client import Client, handle_file

from tests.app.conftest import free_port

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")


@pytest.fixture(scope="module")
def client(app_url) -> Client:
    return Client(app_url, verbose=False, download_files=False)


@pytest.mark.parametrize("m, k", [("8", "4"), (8, 4), (" 16 ", 4.0)])
def test_every_endpoint_takes_m_and_k_as_numbers_or_numeric_strings(client, app_index, m, k):
    from triclip.index.store import load_contents

    row = load_contents(app_index).meta[2]
    at = f"m = {int(m)}"
    for endpoint, first in (
        ("/search_text", "two red circles"), ("/search_image", handle_file(row["image"])), ("/more_like_this", row["id"])
    ):
        gallery, status = client.predict(first, m, False, k, api_name=endpoint)
        assert len(gallery) == 4 and at in status, (endpoint, status)
    rows, status = client.predict(handle_file(row["image"]), m, "false", k, api_name="/image_to_text")
    assert len(rows["data"]) == 4 and at in status and "funnel" not in status


def _call(app_url: str, endpoint: str, data) -> tuple[str, dict | list | None]:
    """POST to Gradio's call route and read the answer: (event, data)."""
    posted = httpx.post(f"{app_url}gradio_api/call/{endpoint}", json={"data": data}, timeout=30)
    posted.raise_for_status()
    answer = httpx.get(f"{app_url}gradio_api/call/{endpoint}/{posted.json()['event_id']}", timeout=60).text
    lines = [line for line in answer.splitlines() if line.strip()]
    event = lines[-2].removeprefix("event: ").strip()
    return event, json.loads(lines[-1].removeprefix("data: "))


@pytest.mark.parametrize(
    "endpoint, data, needle",
    [
        ("search_text", ["a query"], "didn't receive enough input values"),
        ("more_like_this", [1, 2], "didn't receive enough input values"),
        ("search_image", ["not a file", 8, False, 5], "validation error"),
        ("search_image", [{"path": "/etc/passwd"}, 8, False, 5], "must be uploaded"),
        ("image_to_text", [{"path": "/etc/hostname"}, 8, False, 5], "must be uploaded"),
        ("more_like_this", [{"a": 1}, "eight", None, []], "m must be one of"),
        ("search_text", [["q"], ["8"], [True], ["many"]], None),
    ],
)
def test_malformed_payloads_get_a_message_and_no_traceback(app_url, capfd, endpoint, data, needle):
    capfd.readouterr()
    event, answer = _call(app_url, endpoint, data)
    text = json.dumps(answer, ensure_ascii=False)
    assert "null" not in text.split(",")[0], answer  # never {"error": null}
    if event == "error":
        assert answer["error"] and (needle is None or needle in answer["error"]), answer
        assert "malformed request" in answer["error"] or "uploaded" in answer["error"]
    else:  # answered with a status message
        assert "⚠️" in text and (needle is None or needle in text), answer
    assert "Traceback" not in capfd.readouterr().err
    event, answer = _call(app_url, "search_text", ["a green star", "8", False, "3"])  # still serving
    assert event == "complete" and "3 results" in json.dumps(answer, ensure_ascii=False)


def _app_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "triclip", "app", *args]


@pytest.mark.parametrize("port", ["-1", "0", "99999"])
def test_a_port_out_of_range_is_one_line(app_index, port):
    result = subprocess.run(_app_command("--index", str(app_index), "--port", port), capture_output=True, text=True, env=ENV)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"triclip: error: --port must be a whole number from 1 to 65535, got {port}"]


def test_a_port_in_use_is_one_line_and_no_serving_line(app_index):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            _app_command("--index", str(app_index), "--port", str(port)), capture_output=True, text=True, env=ENV
        )
    assert result.returncode == 2 and "serving" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"triclip: error: cannot serve on 127.0.0.1:{port}:"), lines


def test_sigterm_stops_the_app_cleanly(app_index):
    port = free_port()
    app = subprocess.Popen(
        _app_command("--index", str(app_index), "--port", str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        line = app.stdout.readline()  # printed once the port is bound
        assert line.startswith("serving ") and f"127.0.0.1:{port}" in line, line
        assert httpx.get(f"http://127.0.0.1:{port}/triclip/image/0", timeout=30).status_code == 200
        app.send_signal(signal.SIGTERM)
        out, err = app.communicate(timeout=60)
    finally:
        if app.poll() is None:
            app.kill()
    assert app.returncode == 0
    assert "nanobind" not in err and "leaked" not in err and "Traceback" not in err, err
    assert "share=True" not in out + err and "Running on" not in out + err  # Gradio's banner is not printed
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the port is free again
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                time.sleep(0.2)
        except OSError:
            break
    else:
        pytest.fail("the app still listens after SIGTERM")
