"""The app follows its index: an ``index build --add`` while 20 clients search.

A real server on 127.0.0.1 over a 40-record index, checking ``CURRENT`` every 0.2 s;
15 clients on the JSON route and 5 on Gradio's call route (``more_like_this`` of an
image the ``--add`` brings) send queries back to back while the ``--add`` of 20 more
records runs. Bounded: at most 60 s and 400 queries per client. Checked: no failed
request; every answer comes from one version (all its image URLs name the version it
reports, and the first version's answers hold none of the added images); after the swap
the added images show up in answers, without a restart.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx

from tests.app.conftest import make_run, serving, DIMS

CLIENTS_JSON, CLIENTS_GRADIO = 15, 5
DEADLINE_S, MAX_PER_CLIENT = 60.0, 400


def _split_manifest(root: Path) -> tuple[Path, Path, list[str]]:
    """shapes data: base.jsonl (first 40 records) and full.jsonl (60), beside the images; the added keys."""
    from triclip.data.builtin import prepare

    prepare("shapes", str(root / "data"), num=70, seed=1)
    lines = (root / "data" / "train.jsonl").read_text().splitlines()[:60]
    (root / "data" / "base.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (root / "data" / "full.jsonl").write_text("\n".join(lines) + "\n")
    return root / "data" / "base.jsonl", root / "data" / "full.jsonl", [json.loads(x)["image"] for x in lines[40:]]


def test_an_add_while_serving_shows_up_with_no_failed_or_mixed_request(tmp_path):
    from triclip.index.sources import IndexBuildConfig, build_index

    base, full, _ = _split_manifest(tmp_path)
    run = make_run(tmp_path / "run", seed=0)
    index = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(run), data=str(base), out=str(index), dims=DIMS))
    with serving(index, follow=0.2) as (url, app):
        first = app.live.view()
        old_ids = set(first.rows)
        stop = threading.Event()
        failures: list[str] = []
        seen: dict[str, set] = {"json": set(), "gradio": set()}  # versions answered
        added_found = threading.Event()
        counts = [0] * (CLIENTS_JSON + CLIENTS_GRADIO)
        target: dict[str, str] = {}  # an id the --add brings, once known

        def check_one_version(version: str, urls: list[str], ids: list[str]) -> None:
            named = {re.search(r"\?v=(v\d+)$", u).group(1) for u in urls}
            if named - {version}:
                failures.append(f"mixed answer: version {version}, URLs of {named}")
            if version == first.version and set(ids) - old_ids:
                failures.append(f"version {version} answered ids it does not hold: {set(ids) - old_ids}")

        def json_client(n: int) -> None:
            with httpx.Client(timeout=30) as http:
                while not stop.is_set() and counts[n] < MAX_PER_CLIENT:
                    counts[n] += 1
                    try:
                        answer = http.get(f"{url}triclip/api/search_text", params={"q": f"{n % 4} red circles", "k": 12})
                        body = answer.json()
                        assert answer.status_code == 200, body
                    except Exception as err:  # noqa: BLE001 (counted)
                        failures.append(f"json: {type(err).__name__}: {err}")
                        continue
                    seen["json"].add(body["version"])
                    ids = [h["id"] for h in body["hits"]]
                    check_one_version(body["version"], [h["image"] for h in body["hits"]], ids)
                    if set(ids) - old_ids:
                        added_found.set()

        def gradio_client(n: int) -> None:
            with httpx.Client(timeout=60) as http:
                while not stop.is_set() and counts[n] < MAX_PER_CLIENT:
                    counts[n] += 1
                    wanted = target.get("id", "images/000045.png")
                    try:
                        posted = http.post(f"{url}gradio_api/call/more_like_this", json={"data": [wanted, "16", False, "6"]})
                        posted.raise_for_status()
                        text = http.get(f"{url}gradio_api/call/more_like_this/{posted.json()['event_id']}").text
                        event, data = [x for x in text.splitlines() if x.strip()][-2:]
                        assert event == "event: complete", text
                        gallery, status, _ = json.loads(data.removeprefix("data: "))
                    except Exception as err:  # noqa: BLE001 (counted)
                        failures.append(f"gradio: {type(err).__name__}: {err}")
                        continue
                    if "unknown id" in status:  # the first version does not hold it: a message, not a failure
                        seen["gradio"].add(first.version)
                        continue
                    urls = [item["image"]["url"] for item in gallery]
                    version = re.search(r"\?v=(v\d+)$", urls[0]).group(1)
                    seen["gradio"].add(version)
                    check_one_version(version, urls, [])
                    if f"image {wanted}" not in status or len(gallery) != 6:
                        failures.append(f"gradio: unexpected answer {status}")

        threads = [threading.Thread(target=json_client, args=(n,)) for n in range(CLIENTS_JSON)]
        threads += [threading.Thread(target=gradio_client, args=(n,)) for n in range(CLIENTS_JSON, CLIENTS_JSON + CLIENTS_GRADIO)]
        started = time.monotonic()
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            summary = build_index(IndexBuildConfig(run=str(run), data=str(full), out=str(index), add=True))
            assert summary["added"] > 0
            from triclip.index.store import load_contents

            new_meta = load_contents(index).meta
            target["id"] = new_meta[-1]["id"]  # an added image: found only by the new version
            while time.monotonic() - started < DEADLINE_S and not (
                len(seen["json"]) > 1 and len(seen["gradio"]) > 1 and added_found.is_set()
            ):
                time.sleep(0.2)
            time.sleep(0.5)  # a few more answers from the new version
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=90)
    answered = sum(counts)
    assert failures == [], failures[:5]
    assert app.live.swaps == 1 and app.live.view().version != first.version
    assert seen["json"] == seen["gradio"] == {first.version, app.live.view().version}, seen
    assert added_found.is_set(), "no answer held an added image"
    assert answered >= 40, answered
    print(f"{answered} requests from {len(threads)} clients, 0 failed, versions {sorted(seen['json'])}")


def test_a_rebuild_with_another_run_is_swapped_in_and_old_urls_keep_their_images(tmp_path):
    from triclip.index.sources import IndexBuildConfig, build_index
    from triclip.index.store import load_contents

    base, full, _ = _split_manifest(tmp_path)
    backwards = tmp_path / "data" / "backwards.jsonl"  # the same images in another order: rows change meaning
    backwards.write_text("\n".join(reversed(full.read_text().splitlines())) + "\n")
    runs = [make_run(tmp_path / f"run{seed}", seed=seed) for seed in (0, 1)]
    index = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(runs[0]), data=str(full), out=str(index), dims=DIMS))
    old_meta = load_contents(index).meta
    with serving(index, follow=0) as (url, app):  # follow=0: swapped by reload() here, not by a timer
        first = app.live.view()
        assert app.live.reload() is False  # nothing new yet
        build_index(IndexBuildConfig(run=str(runs[1]), data=str(backwards), out=str(index), dims=DIMS, overwrite=True))
        new_meta = load_contents(index).meta
        assert app.live.reload() is True
        now = app.live.view()
        assert now.version != first.version and now.searcher.model is not first.searcher.model  # the new run loaded
        assert now.searcher.manifest["fingerprint"] != first.searcher.manifest["fingerprint"]
        assert old_meta[0]["image"] != new_meta[0]["image"]
        for version, meta in ((first.version, old_meta), (now.version, new_meta)):  # each URL: its own version's row 0
            served = httpx.get(f"{url}triclip/image/0?v={version}", timeout=30).content
            assert served == Path(meta[0]["image"]).read_bytes()
        body = httpx.get(f"{url}triclip/api/search_text", params={"q": "a red circle", "k": 3}, timeout=30).json()
        assert body["version"] == now.version and len(body["hits"]) == 3


def test_a_damaged_new_version_is_logged_and_the_loaded_one_kept(tmp_path, caplog):
    import logging

    from triclip.index.sources import IndexBuildConfig, build_index

    base, _, _ = _split_manifest(tmp_path)
    index = tmp_path / "index"
    build_index(IndexBuildConfig(run=str(make_run(tmp_path / "run", seed=0)), data=str(base), out=str(index), dims=DIMS))
    caplog.set_level(logging.WARNING, logger="triclip.app")
    with serving(index, follow=0.1) as (url, app):
        first = app.live.view()
        (index / "v000002").mkdir()
        (index / "v000002" / "manifest.json").write_text('{"format": 2}')  # complete-looking, garbled
        (index / "CURRENT").write_text("v000002\n")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("did not load" in r.getMessage() for r in caplog.records):
            app.live.view()  # a request's check starts the background load
            time.sleep(0.1)
        kept = [r.getMessage() for r in caplog.records if "did not load" in r.getMessage()]
        assert len(kept) == 1 and "keeping version v000001" in kept[0] and "damaged" in kept[0]
        assert app.live.view() is first and app.live.swaps == 0
        body = httpx.get(f"{url}triclip/api/search_text", params={"q": "a red circle", "k": 3}, timeout=30).json()
        assert body["version"] == first.version and len(body["hits"]) == 3
        time.sleep(0.5)
        assert len([r for r in caplog.records if "did not load" in r.getMessage()]) == 1  # not retried until CURRENT changes
