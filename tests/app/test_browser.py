"""The app in a real headless browser (Debian chromium driven by the PyPI playwright package).

Reads the feature-selection panel (spectrum words and plot, the recall-against-m
chart), types a query and waits for the gallery, checks that every result image
loaded whole with its full caption, uploads an image, clicks a result ("more like
this"), switches m (the full-D results and their overlap appear) and the funnel, and
checks that the page asked nothing of any host but the app's own 127.0.0.1.

Also a tool for the README's screenshot, on a running app:

    python -m tests.app.test_browser http://127.0.0.1:7860/ docs/app.png "a red apple" [M]
"""

from __future__ import annotations

import json
import os
import sys
from urllib.parse import urlparse

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000  # per wait: the shared 2-core CI machine can be slow

pytestmark = pytest.mark.slow


def _status(page) -> str:
    return page.locator("#status").inner_text()


def _wait_status(page, needle: str) -> str:
    """Wait until the status line contains ``needle``; returns it."""
    page.wait_for_function(
        "needle => (document.querySelector('#status')?.innerText || '').includes(needle)", arg=needle, timeout=TIMEOUT_MS
    )
    return _status(page)


def _assert_idle_page_does_not_flash(page) -> None:
    """Over more than one refresh interval of an idle page, nothing drawn is marked pending (Gradio's fade and
    progress timer): the timer's version check touches no component."""
    from triclip.app.gradio_app import REFRESH_S

    page.evaluate("""() => { window.__flashes = 0;
        new MutationObserver(ms => { for (const m of ms) if (m.target.classList?.contains('pending')
            || m.target.querySelector?.('.pending, .progress-text, .eta-bar')) window.__flashes++; })
          .observe(document.body, {subtree: true, childList: true, attributes: true, attributeFilter: ['class']}); }""")
    page.wait_for_timeout(int((REFRESH_S + 3) * 1000))
    assert page.evaluate("window.__flashes") == 0


def _wait_caption_status(page, needle: str) -> str:
    """Wait until the caption table's status line contains ``needle``; returns it."""
    page.wait_for_function(
        "needle => (document.querySelector('#caption-status')?.innerText || '').includes(needle)", arg=needle,
        timeout=TIMEOUT_MS,
    )
    return page.locator("#caption-status").inner_text()


def _wait_images_loaded(page) -> list[int]:
    """Wait until every gallery image has decoded; returns their natural widths."""
    page.wait_for_function(
        """() => { const imgs = [...document.querySelectorAll('#results img')];
                   return imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0); }""",
        timeout=TIMEOUT_MS,
    )
    return page.evaluate("[...document.querySelectorAll('#results img')].map(i => i.naturalWidth)")


def open_page(playwright, url: str, requests: list[str]):
    """Headless chromium on ``url``; every URL the page requests is appended to ``requests``."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 1700})
    page.on("request", lambda request: requests.append(request.url))
    page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
    page.wait_for_selector("#query", timeout=TIMEOUT_MS)
    return browser, page


def text_search(page, query: str) -> list[int]:
    page.locator("#query textarea, #query input").first.fill(query)
    page.locator("#search").click()
    _wait_status(page, f"for “{query[:20]}")
    return _wait_images_loaded(page)


@pytest.fixture
def browser_requests():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium (scripts/setup.sh does)")
    return []


def test_search_upload_click_and_switch_m_in_a_browser(app_url, app_index, browser_requests):
    from playwright.sync_api import sync_playwright

    from triclip.index.store import load_contents

    meta = load_contents(app_index).meta
    upload = meta[7]["image"]
    row_of = {row["id"].rsplit("/", 1)[-1]: i for i, row in enumerate(meta)}  # by file name, as the status names it
    with sync_playwright() as p:
        browser, page = open_page(p, app_url, browser_requests)
        try:
            spectrum = page.locator("#spectrum").inner_text()  # the feature-selection panel
            assert "Importance S of 32 dimensions" in spectrum and "Suggested m = " in spectrum
            page.wait_for_selector("#spectrum-plot img", state="attached", timeout=TIMEOUT_MS)  # matplotlib: a PNG
            assert "recall@10 against m" in page.locator("#recall-text").inner_text()
            page.wait_for_selector("#recall-chart img", state="attached", timeout=TIMEOUT_MS)
            assert page.locator("#clicked-id").count() == 0  # no id box: a result is clicked
            _assert_idle_page_does_not_flash(page)

            widths = text_search(page, "two red circles in the center")
            assert len(widths) == 12 and min(widths) > 0  # k = 12 by default; every image decoded
            assert "m = 32 = D" in _status(page)
            assert _whole_thumbnails_and_captions(page)

            page.get_by_role("tab", name="Image → image / text").click()
            page.locator("#query-image input[type=file]").set_input_files(upload)
            status = _wait_status(page, "for the uploaded image")
            assert status.startswith("12 results")
            first = page.locator("#results img").first.get_attribute("src")
            assert urlparse(first).path.endswith("/triclip/image/7")  # the uploaded image (row 7) finds itself first

            page.locator("#results button.thumbnail-item").nth(2).click()  # more like this
            status = _wait_status(page, "for images like ")
            clicked = status.split("for images like ", 1)[1].split(" · ")[0].rsplit("(", 1)[1].rstrip(")")
            assert clicked in row_of  # the image by its caption and file name, never its stored path
            box = page.locator("#query textarea, #query input").first
            page.wait_for_function("() => (document.querySelector('#query textarea, #query input')?.placeholder || '')"
                                   ".startsWith('showing images like')", timeout=TIMEOUT_MS)
            assert box.input_value() == "" and f"({clicked})" in box.get_attribute("placeholder")
            _wait_images_loaded(page)
            first = page.locator("#results img").first.get_attribute("src")
            assert urlparse(first).path.endswith(f"/triclip/image/{row_of[clicked]}")

            page.locator('#m input[value="8"]').click()  # the last query runs again at m = 8, full D beside it
            status = _wait_status(page, "m = 8")
            assert f"({clicked})" in status
            page.wait_for_function(
                "() => (document.querySelector('#overlap')?.innerText || '').includes('shared')", timeout=TIMEOUT_MS
            )
            overlap = page.locator("#overlap").inner_text()
            assert " of 12 shared between the results at m = 8" in overlap
            page.wait_for_function(
                "() => document.querySelectorAll('#full-results img').length === 12", timeout=TIMEOUT_MS
            )
            page.locator("#funnel input").click()
            status = _wait_status(page, "funnel")  # every m the index holds has its measured recall
            assert "funnel: shortlist at m = 8 (recall@10 0." in status and "re-rank at D = 32" in status
            _wait_images_loaded(page)
        finally:
            browser.close()
    hosts = {urlparse(u).netloc for u in browser_requests if urlparse(u).scheme in ("http", "https", "ws", "wss")}
    assert hosts == {urlparse(app_url).netloc}, f"requests left the app: {sorted(hosts)}"


def _whole_thumbnails_and_captions(page) -> bool:
    """Every result image is drawn whole (contained, no caption over it) and every caption is shown in full.

    Waited for (layout settles after the images decode); False when it never holds.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            """() => { const items = [...document.querySelectorAll('#results button.thumbnail-item')];
                return items.length > 0 && items.every(item => {
                const img = item.querySelector('img'), label = item.querySelector('.caption-label');
                const box = img.getBoundingClientRect(), cap = label.getBoundingClientRect();
                return getComputedStyle(img).objectFit === 'contain' && cap.top >= box.bottom - 1
                    && label.scrollWidth <= label.clientWidth + 1 && label.scrollHeight <= label.clientHeight + 1; }); }""",
            timeout=TIMEOUT_MS,
        )
    except PlaywrightTimeout:
        return False
    return True


def screenshot(url: str, out: str, query: str, m: str | None = None) -> None:
    """Search ``query`` on a running app (then pick ``m``, e.g. "32" or a budget "8B": full D shown beside) and save
    a screenshot to ``out``."""
    from playwright.sync_api import sync_playwright

    requests: list[str] = []
    with sync_playwright() as p:
        browser, page = open_page(p, url, requests)
        page.set_viewport_size({"width": 1400, "height": 1000})
        text_search(page, query)
        if m is not None:
            page.locator(f'#m input[value="{m}"]').click()
            _wait_status(page, f"{m[:-1]} B per image" if m.endswith("B") else f"m = {m}")  # a budget's codes, or an m
            page.wait_for_function(
                "() => (document.querySelector('#overlap')?.innerText || '').includes('shared')", timeout=TIMEOUT_MS
            )
            _wait_images_loaded(page)
            page.wait_for_function(
                """() => [...document.querySelectorAll('#full-results img')].every(i => i.complete && i.naturalWidth > 0)""",
                timeout=TIMEOUT_MS,
            )
            # Gradio fades an output whose event is still pending: shoot once nothing is
            page.wait_for_function("() => document.querySelectorAll('.pending').length === 0", timeout=TIMEOUT_MS)
        page.screenshot(path=out, full_page=True)
        browser.close()
    outside = sorted({urlparse(u).netloc for u in requests} - {urlparse(url).netloc})
    print(f"wrote {out}; hosts other than the app: {outside or 'none'}")


if __name__ == "__main__":
    screenshot(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "a red apple", sys.argv[4] if len(sys.argv) > 4 else None)


def test_a_byte_budget_and_the_frontier_in_a_browser(tmp_path, browser_requests):
    """The control offers the byte budgets with bytes and size, a budget answers, and the frontier chart is drawn;
    after an --overwrite with other budgets the open page's choices follow without a reload."""
    from playwright.sync_api import sync_playwright

    from triclip.index.sources import IndexBuildConfig, build_index
    from tests.app.conftest import serving, small_index

    index = small_index(tmp_path, num=60, bytes=[4, 8])
    with serving(index, follow=0.2) as (url, _), sync_playwright() as p:
        browser, page = open_page(p, url, browser_requests)
        try:
            page.wait_for_selector("#frontier-chart img", state="attached", timeout=TIMEOUT_MS)
            assert "the codes this index stores (4 B →" in page.locator("#frontier-text").inner_text()
            wrap = page.locator("#frontier-text td").first.evaluate(  # the budgets' table: never broken mid-word
                "e => [getComputedStyle(e).wordBreak, getComputedStyle(e).overflowWrap]")
            assert wrap == ["normal", "normal"]
            label = page.locator("#m").inner_text()
            assert "B/image stored" in label and "8 B budget: " in label
            text_search(page, "two red circles")
            page.locator('#m input[value="8B"]').click()  # the last query again, by the 8-byte codes
            status = _wait_status(page, "8 B per image")
            assert status.startswith("12 results")
            _wait_images_loaded(page)
            page.get_by_role("tab", name="Image → image / text").click()  # image -> text by the 8-byte caption codes
            upload = tmp_path / "data" / json.loads((tmp_path / "data" / "train.jsonl").read_text().splitlines()[0])["image"]
            page.locator("#query-image input[type=file]").set_input_files(str(upload))
            _wait_status(page, "for the uploaded image")
            page.locator("#image-to-text").click()
            status = _wait_caption_status(page, "8 B per caption")
            assert status.startswith("12 captions") and "i2t recall@10" in status
            page.locator('#m input[value="4B"]').click()  # the caption table follows the choice, as the gallery does
            assert _wait_caption_status(page, "4 B per caption").startswith("12 captions")
            _wait_status(page, "4 B per image")
            page.locator('#m input[value="32"]').click()  # full D: the image->text figure, not text->image's
            status = _wait_caption_status(page, "m = 32 = D")
            assert "i2t recall@10" in status
            lines = (tmp_path / "data" / "train.jsonl").read_text().splitlines()
            page.locator("#query-image input[type=file]").set_input_files(
                str(tmp_path / "data" / json.loads(lines[1])["image"]))  # another image: the captions were the last one's
            page.wait_for_function("() => (document.querySelector('#caption-status')?.innerText || '').trim() === ''",
                                   timeout=TIMEOUT_MS)
            page.locator('#m input[value="8"]').click()  # the table is not re-run for the image it no longer answers
            _wait_status(page, "m = 8")
            page.wait_for_function("() => document.querySelectorAll('.pending').length === 0", timeout=TIMEOUT_MS)
            assert page.locator("#caption-status").inner_text().strip() == ""  # (a pending event shows its timer)
            explained = page.locator("#choices-explained").inner_text()  # what each choice costs and keeps
            assert "stored per image" in explained and "± about" in explained  # the recall's noise, said
            assert explained.count("bytes per vector") >= 2  # each budget's code in plain words (codecs.describe)
            build_index(IndexBuildConfig(run=str(tmp_path / "run"), data=str(tmp_path / "data" / "train.jsonl"),
                                         out=str(index), dims=[8, 16], bytes=[16], overwrite=True))
            page.wait_for_selector('#m input[value="16B"]', state="attached", timeout=TIMEOUT_MS)  # the timer redraws
            assert page.locator('#m input[value="8B"]').count() == 0
            assert "(16 B →" in page.locator("#frontier-text").inner_text()
        finally:
            browser.close()
    assert {urlparse(u).netloc for u in browser_requests} == {urlparse(url).netloc}
