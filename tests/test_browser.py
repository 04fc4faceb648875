"""The knob panel in a real browser: JupyterLab on 127.0.0.1 (token-protected), driven by headless Chromium.

The test starts a JupyterLab server over a copy of ``notebooks/`` (the committed notebooks are never touched), opens
``01_quickstart.ipynb``, runs all its cells (``LAB_SMOKE=1``: the panel cell is the last), changes the panel's
pooling dropdown to ``cls``, presses Run and waits until the heatmap image and the stats line differ from the first
run's. The screenshot goes to ``evals/results/panel/panel.png`` (shown in the README). The server and the browser are
shut down however the test ends. It needs Chromium and ChromeDriver (Debian's ``chromium`` / ``chromium-driver``, which
``.ci/setup`` installs when it can), selenium and jupyterlab; without them it skips and says which is missing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from lab._repo import ROOT

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SCREENSHOT = ROOT / "evals" / "results" / "panel" / "panel.png"
WAIT_S = 300  # 2 cores: JupyterLab's first load, a kernel start and the notebook's cells


def _missing() -> str | None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        return (
            "no Chromium / ChromeDriver on PATH (apt-get install chromium chromium-driver; .ci/setup does it as root)"
        )
    for module in ("selenium", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[dev]')"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 over a copy of notebooks/, with a random token; stopped afterwards."""
    if (why := _missing()) is not None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("browser")
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    port, token = _free_port(), secrets.token_hex(16)
    news = root / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')  # no "official Jupyter news?" toast over the screenshot
    # start the notebook's own kernel (python3) without asking: no "Select Kernel" dialog, whenever kernelspecs load
    tracker = root / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text('{"autoStartDefaultKernel": true}')
    env = {
        **os.environ,
        "LAB_SMOKE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "JUPYTER_CONFIG_DIR": str(root / "config"),
        "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
    }
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root / 'notebooks'}",
        f"--LabApp.workspaces_dir={root / 'workspaces'}",
        f"--LabApp.user_settings_dir={root / 'settings'}",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        *(["--allow-root"] if os.geteuid() == 0 else []),
    ]  # CI machines run as root
    log = (root / "server.log").open("w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{(root / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token, root
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    if (why := _missing()) is not None:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1500,1800",
        "--force-device-scale-factor=1",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def test_panel_runs_in_jupyterlab(jupyter, browser):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    base, token, root = jupyter
    # the panel replaces its widgets' DOM as it redraws: an element found a moment ago may be gone; look again
    wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))

    def panel(name: str):
        return browser.find_element(By.CSS_SELECTOR, f".lab-panel-{name}")

    def steady(fn):
        """``fn()``'s value, retried while the panel redraws under it (a stale element)."""
        return wait.until(lambda d: (fn(),))[0]

    def heatmap_src() -> str | None:
        imgs = browser.find_elements(By.CSS_SELECTOR, ".lab-panel-plot img")
        return imgs[0].get_attribute("src") if imgs else None

    # the notebook's session and kernel exist before the page opens: JupyterLab attaches to them instead of asking
    # which kernel to start (it asks when the kernelspecs have not loaded yet as it opens the notebook)
    req = urllib.request.Request(
        f"{base}/api/sessions",
        method="POST",
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
        data=json.dumps(
            {
                "path": "01_quickstart.ipynb",
                "type": "notebook",
                "name": "01_quickstart.ipynb",
                "kernel": {"name": "python3"},
            }
        ).encode(),
    )
    urllib.request.urlopen(req, timeout=60).close()
    try:  # on any failure, a screenshot of the page (failed.png) beside the server log in the test's tmp folder
        browser.get(f"{base}/lab/tree/01_quickstart.ipynb?token={token}")
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")))
        # Should JupyterLab still ask which kernel to start (a modal that would swallow the clicks below), accept its
        # choice once it names Python 3; go on when the kernel is idle and no dialog is open, twice in a row
        settled, deadline = 0, time.monotonic() + WAIT_S
        while settled < 2 and time.monotonic() < deadline:
            try:
                dialogs = browser.find_elements(By.CSS_SELECTOR, ".jp-Dialog")
                idle = browser.find_elements(By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']")
                if dialogs:
                    accept = dialogs[0].find_elements(By.CSS_SELECTOR, "button.jp-mod-accept")
                    if accept and "Python 3" in dialogs[0].text:
                        accept[0].click()
                settled = settled + 1 if idle and not dialogs else 0
            except StaleElementReferenceException:  # the dialog closed as we read it
                settled = 0
            time.sleep(1)
        assert settled == 2, "the notebook's kernel never became idle with no dialog open"
        # Run -> Run All Cells (the panel cell is the notebook's last)
        browser.find_element(By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel') and text()='Run']").click()
        wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "li[data-command='runmenu:run-all']"))).click()

        wait.until(lambda d: heatmap_src() and "stats of the last call" in panel("stats-view").text)
        first_src, first_stats = steady(heatmap_src), steady(lambda: panel("stats-view").text)
        assert first_src.startswith("data:image/png;base64,")
        assert "packed" in first_stats and "384" in first_stats  # the call's path and the embedding size

        steady(lambda: Select(panel("pooling").find_element(By.TAG_NAME, "select")).select_by_visible_text("cls"))
        wait.until(lambda d: "cls" in panel("resolved-view").text)  # configure ran in the kernel
        steady(lambda: panel("run-button").click())
        wait.until(lambda d: heatmap_src() not in (None, first_src) and panel("stats-view").text != first_stats)
        error = steady(lambda: panel("error").text.strip())
        assert error == "", error
    except Exception:
        browser.save_screenshot(str(root / "failed.png"))
        raise

    steady(lambda: browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", panel("pooling")))
    time.sleep(0.5)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 10_000
