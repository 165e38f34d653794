"""The built site as a reader sees it: served over HTTP and opened in headless Chromium through Selenium.

Screenshots of the home page, a guide and an API page go to the test's ``tmp_path``; the assertions are on what
the browser renders (visible elements and their text), not on the HTML files. Needs Debian's ``chromium`` and
``chromium-driver`` (``.ci/run`` installs them) and ``selenium`` (the ``[docs]`` extra). Where they are missing
the test skips with one line saying why; under CI (``CI=true``) or with ``POLYATTN_REQUIRE_BROWSER=1`` that line
fails it instead.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"


def browser_required() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("POLYATTN_REQUIRE_BROWSER") == "1"


def unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail with it where a browser is required."""
    if browser_required():
        pytest.fail(f"a browser is required here (CI=true or POLYATTN_REQUIRE_BROWSER=1), but {reason}", pytrace=False)
    pytest.skip(f"no headless browser: {reason}")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


@pytest.fixture(scope="module")
def served(site):
    """The built site on ``http://127.0.0.1:<free port>/``, served by Python's http.server from a thread."""
    assert site.returncode == 0, "the site did not build:\n" + site.output[-4000:]
    handler = functools.partial(QuietHandler, directory=str(site.html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by chromedriver (never selenium-manager: there is no network)."""
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
    except ImportError as error:
        unavailable(f"selenium is not installed ({error}; pip install -e '.[docs]')")
    binary = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    driver_path = shutil.which(DRIVER)
    if binary is None or driver_path is None:
        missing = " and ".join(n for n, p in (("chromium", binary), (DRIVER, driver_path)) if p is None)
        unavailable(f"{missing} not on PATH (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    try:
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    except WebDriverException as error:
        unavailable(f"{binary} did not start under {driver_path}: {error.msg or error}".splitlines()[0])
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def screenshot(browser, path: Path) -> None:
    assert browser.save_screenshot(str(path)), path
    print(f"screenshot: {path}")


def open_page(browser, url: str):
    """Load ``url``; returns ``visible(css)``: the elements a reader can see that match ``css``."""
    from selenium.webdriver.common.by import By

    browser.get(url)
    return lambda css: [e for e in browser.find_elements(By.CSS_SELECTOR, css) if e.is_displayed()]


def test_the_home_page_shows_the_navigation(browser, served, tmp_path):
    visible = open_page(browser, served + "index.html")
    screenshot(browser, tmp_path / "home.png")
    assert browser.title.startswith("polyattn_lightning"), browser.title
    assert [h.text for h in visible("article h1")] == ["polyattn_lightning"]
    captions = [c.text for c in visible(".sidebar-tree .caption")]
    assert captions == ["START", "HOW-TO GUIDES", "REFERENCE", "PROJECT"], captions  # furo's CSS capitalises
    links = {a.text: a.get_attribute("href") for a in visible(".sidebar-tree a.reference")}
    for text, page in [
        ("Getting started", "getting-started.html"),
        ("Run a grid: the papers’ experiments", "howto/grids.html"),
        ("Python API", "api/index.html"),
        ("Contributing", "contributing.html"),
    ]:
        assert links.get(text) == served + page, (text, sorted(links))
    assert visible("input.sidebar-search"), "no search box in the sidebar"


def test_a_guide_shows_its_code_and_its_table(browser, served, tmp_path):
    visible = open_page(browser, served + "howto/grids.html")
    screenshot(browser, tmp_path / "guide.png")
    assert browser.title.startswith("Run a grid"), browser.title
    assert [h.text for h in visible("article h1")] == ["Run a grid: the papers’ experiments"]
    # the sidebar marks the page being read
    assert [a.text for a in visible(".sidebar-tree li.current-page > a")] == ["Run a grid: the papers’ experiments"]
    assert "<!--" not in visible("article")[0].text, "a code block's marker (an HTML comment) shows"
    yaml = visible("div.highlight-yaml pre")
    assert yaml and "axes:" in yaml[0].text and "```" not in yaml[0].text
    assert yaml[0].find_elements("css selector", "span.nt"), "the YAML block is not highlighted (no key tokens)"
    bash = [pre.text for pre in visible("div.highlight-bash pre")]
    assert any(text.startswith("polyattn grid digits_grid.yaml --dry-run") for text in bash), bash
    table = visible("article table")[0]  # the papers' tables; the report's columns follow further down
    head = [th.text for th in table.find_elements("css selector", "thead th")]
    assert head == ["paper table", "grid", "small variant, on generated data"], head
    rows = table.find_elements("css selector", "tbody tr")
    assert len(rows) == 5 and rows[0].find_elements("css selector", "td")[2].text == "digits_table1.yaml"
    assert table.size["width"] > 400 and table.size["height"] > 5 * 20, table.size


def test_an_api_page_shows_set_attention(browser, served, tmp_path):
    url = served + "api/polyattn_lightning.html"
    visible = open_page(browser, url)
    assert browser.title == "The top-level API - polyattn_lightning", browser.title
    assert [h.text for h in visible("article h1")] == ["The top-level API"]
    (entry,) = visible("dt#polyattn_lightning\\.set_attention")
    browser.execute_script("arguments[0].scrollIntoView({behavior: 'instant'})", entry)  # not smooth
    screenshot(browser, tmp_path / "api.png")
    assert entry.text.startswith("polyattn_lightning.set_attention(model"), entry.text
    body = entry.find_element("xpath", "following-sibling::dd")
    assert "Args:" not in body.text and body.find_elements("css selector", "dl.field-list"), "napoleon did not render"


def test_the_search_finds_set_attention(browser, served, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    visible = open_page(browser, served + "search.html?q=set_attention")
    WebDriverWait(browser, 60, poll_frequency=0.2).until(
        lambda _: any(p.text.startswith("Search finished") for p in visible("p.search-summary")),
        "the search page did not finish searching for set_attention within 60 s",
    )  # the results are listed one by one; the summary comes after the last
    screenshot(browser, tmp_path / "search.png")
    hrefs = [a.get_attribute("href") for a in visible("ul.search li a")]
    assert served + "api/polyattn_lightning.html#polyattn_lightning.set_attention" in hrefs, hrefs
