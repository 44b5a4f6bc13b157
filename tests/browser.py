"""A real browser on the playground: headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
``scripts/ensure_chromium.sh``) driven by selenium with the system's chromedriver (selenium's own driver
manager never runs, and nothing is downloaded).

``run_playground(url, prompt, params, screenshot)`` opens ``url + "/playground"``, fills the form, clicks
Send, waits for the stream to end (``#status`` reads ``done``), saves a PNG screenshot of the whole page and
returns what the page shows."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1280, 1000)
FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
    "--disable-extensions", "--disable-default-apps", "--disable-domain-reliability", "--no-pings",
    "--disable-client-side-phishing-detection", "--disable-features=Translate,MediaRouter,OptimizationHints",
    "--no-proxy-server", "--hide-scrollbars", "--force-device-scale-factor=1",
)

# form fields by request parameter name (the element ids of app/static/playground.html)
FIELDS = {"threshold": "threshold", "slo_ms": "slo", "slo": "slo", "temperature": "temperature",
          "max_tokens": "max-tokens", "seed": "seed", "api_key": "api-key"}


def chromium_available() -> bool:
    """Chromium, its driver and selenium are all here."""
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        return False
    try:
        import selenium.webdriver  # noqa: F401
    except ImportError:
        return False
    return True


def missing_reason() -> str:
    """Why ``chromium_available()`` is false (a skip reason)."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    try:
        import selenium.webdriver  # noqa: F401
    except ImportError:
        missing.append("the selenium package (the dev extra)")
    return ("needs " + ", ".join(missing) + " (run scripts/ensure_chromium.sh)") if missing else ""


def start_browser(user_data_dir: str, window: tuple[int, int] = WINDOW):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir}")
    options.add_argument(f"--window-size={window[0]},{window[1]}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # an explicit driver path: selenium's driver manager (which could download one) is skipped
    return webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)


def _fill(driver, element_id: str, value) -> None:
    from selenium.webdriver.common.by import By

    el = driver.find_element(By.ID, element_id)
    el.clear()
    if value is not None and value != "":
        el.send_keys(str(value))


def run_playground(url: str, prompt: str, params: dict, screenshot: Path, timeout_s: float = 120) -> dict:
    """Open the playground at ``url``, send ``prompt`` with ``params`` (threshold, slo_ms, temperature,
    max_tokens, seed, model, api_key; ``None`` or "" leaves a field empty), wait for the stream's end and save
    a screenshot. Returns ``answer`` (the text of ``#answer``), ``rounds`` (``#status``'s ``data-rounds``),
    ``cells_committed`` (committed canvas cells), ``committed_positions``, ``cells`` (the canvas length),
    ``status``, ``cluster`` (the cluster panel's update line), ``console_errors`` (the page's severe console
    messages) and ``seconds`` (Send to the stream's end). Raises ``RuntimeError`` when the page ends with an
    error (after the screenshot)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    unknown = set(params) - set(FIELDS) - {"model"}
    if unknown:
        raise ValueError(f"unknown playground parameters: {sorted(unknown)}")
    screenshot = Path(screenshot)
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="remask-chromium-")
    driver = start_browser(tmp)
    try:
        driver.set_page_load_timeout(timeout_s)
        driver.get(url.rstrip("/") + "/playground")
        wait = WebDriverWait(driver, timeout_s, poll_frequency=0.05)
        wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
        if "api_key" in params:  # first: the model list is fetched with it
            _fill(driver, "api-key", params["api_key"])
            driver.execute_script("document.getElementById('api-key').dispatchEvent(new Event('change'))")
        for name, value in params.items():
            if name not in ("model", "api_key"):
                _fill(driver, FIELDS[name], value)
        if params.get("model"):
            model = params["model"]
            wait.until(lambda d: d.execute_script(
                "return [...document.getElementById('model').options].some(o => o.value === arguments[0])", model))
            Select(driver.find_element(By.ID, "model")).select_by_value(model)
        _fill(driver, "prompt", prompt)
        t0 = time.monotonic()
        driver.find_element(By.ID, "send").click()
        status = driver.find_element(By.ID, "status")
        wait.until(lambda d: status.text == "done" or status.text.startswith("error"))
        seconds = time.monotonic() - t0
        result = driver.execute_script("""
            const cells = [...document.querySelectorAll('#canvas .cell')];
            const done = cells.filter(c => c.classList.contains('committed'));
            const s = document.getElementById('status');
            return {answer: document.getElementById('answer').textContent, status: s.textContent,
                    rounds: Number(s.dataset.rounds), cells: cells.length, cells_committed: done.length,
                    committed_positions: done.map(c => Number(c.dataset.pos)),
                    cluster: document.getElementById('cluster-updated').textContent};
        """)
        result["seconds"] = round(seconds, 3)
        result["console_errors"] = [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        height = driver.execute_script("return Math.ceil(document.documentElement.scrollHeight)")
        if height > WINDOW[1]:  # the whole page in the screenshot
            driver.set_window_size(WINDOW[0], min(int(height) + 140, 4000))
        time.sleep(0.3)  # the last cells' colour transitions
        driver.save_screenshot(str(screenshot))
        if result["status"] != "done":
            raise RuntimeError(f"the playground ended with {result['status']!r}")
        return result
    finally:
        driver.quit()
        shutil.rmtree(tmp, ignore_errors=True)
