"""What a learner does, in a real browser: open JupyterLab, run chapter 00, move the slider.

The test starts JupyterLab (bound to 127.0.0.1, random token, free port) on a temporary folder
that holds *copies* of the notebooks (JupyterLab autosaves; the generated notebooks/ must not
change), drives headless Chromium with Playwright, and checks from the page itself that

* every cell of notebooks/00-orientation runs without an error output,
* the matplotlib figure and the ipywidgets temperature explorer render, and moving the slider
  changes the printed probabilities (checked against ``softmax(scores / T)``),
* the nbgrader JupyterLab extension is there on the solutions of chapter 01: the "Nbgrader" menu,
  the "Validate" button and the "Create Assignment" panel with the notebook's grade ids and points.

Screenshots (and the server log) are written to test-artifacts/browser/. The test is skipped,
with the reason, when Playwright or the Debian Chromium (/usr/bin/chromium) is missing.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import ROOT

try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    pytest.skip("playwright is not installed (pip install -e . installs it)", allow_module_level=True)

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)")

ARTIFACTS = ROOT / "test-artifacts" / "browser"
ORIENTATION = "notebooks/00-orientation/orientation.ipynb"
SOLUTION = "solutions/01-attention/attention.ipynb"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--no-proxy-server"]
# JupyterLab user settings for the test server: no news feed, no update check (no requests
# leave 127.0.0.1) and so no "Would you like to get notified..." toast over the page.
LAB_SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
                {"fetchNews": "false", "checkForUpdates": False}}

SERVER_START_S = 60      # JupyterLab answering on /api
KERNEL_IDLE_MS = 60_000  # kernel started and idle
RUN_ALL_MS = 90_000      # every cell of chapter 00 executed
UI_MS = 30_000           # any other wait on the page
# What chapter 00's temperature explorer shows: softmax(SCORES / T) over LABELS.
SCORES = [2.0, 1.0, 0.5, -1.0]
EXPLORER_LINE = re.compile(r"^T = (\d+\.\d\d) → p\(mat\) = (\d\.\d{3}),")


# --------------------------------------------------------------------------- JupyterLab server


@pytest.fixture(scope="module", autouse=True)
def fresh_artifacts():
    """Empty test-artifacts/browser/ so that what it holds comes from this run."""
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)


def _artifact(name: str) -> Path:
    """The path of an artifact file (the folder is created if it went missing)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


def _free_port() -> int:
    """A TCP port that nothing listens on at 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prepare_root(tmp: Path) -> Path:
    """A folder laid out like the course, with copies of the two notebooks and the nbgrader config."""
    root = tmp / "course"
    for relative in (ORIENTATION, SOLUTION, "nbgrader_config.py"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, root / relative)
    for name, settings in LAB_SETTINGS.items():
        path = tmp / "lab-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    return root


def _wait_for_api(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Poll ``url`` (no proxy) until it answers 200; fail early if the server process exits."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"JupyterLab exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with opener.open(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    pytest.fail(f"JupyterLab did not answer on {url} within {timeout_s} s:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """Stop the server by its PID: SIGTERM (it shuts its kernels down), SIGKILL after 15 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on copies of the notebooks; yields its base URL and token."""
    tmp = tmp_path_factory.mktemp("lab")
    root = _prepare_root(tmp)
    port, token = _free_port(), secrets.token_hex(16)
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               f"--LabApp.user_settings_dir={tmp / 'lab-settings'}",
               f"--LabApp.workspaces_dir={tmp / 'lab-workspaces'}",
               "--LabApp.news_url=None", "--LabApp.extension_manager=readonly",
               "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI machines often run as root
        command.append("--allow-root")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
    log = _artifact("jupyter-server.log")
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_for_api(f"http://127.0.0.1:{port}/api", process, log, SERVER_START_S)
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "root": root}
    finally:
        _stop(process)


# --------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def browser():
    """Headless Debian Chromium driven by Playwright."""
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, request):
    """A fresh page; its console messages go to test-artifacts/browser/<test>.console.log."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(UI_MS)
    expect.set_options(timeout=UI_MS)
    new_page = context.new_page()
    messages: list[str] = []
    new_page.on("console", lambda message: messages.append(f"{message.type}: {message.text}"))
    new_page.on("pageerror", lambda error: messages.append(f"pageerror: {error}"))
    try:
        yield new_page
    finally:
        _artifact(f"{request.node.name}.console.log").write_text("\n".join(messages) + "\n")
        context.close()


def _screenshot(page: Page, name: str) -> None:
    """Save what the page shows now as test-artifacts/browser/<name>.png."""
    page.screenshot(path=str(_artifact(f"{name}.png")))


@contextmanager
def _screenshot_on_failure(page: Page, name: str):
    """Keep what the page showed when a check failed."""
    try:
        yield
    except BaseException:
        _screenshot(page, f"{name}-FAILED")
        raise


# --------------------------------------------------------------------------- JupyterLab steps


def _open_notebook(page: Page, lab: dict, path: str):
    """Open ``path`` in a fresh JupyterLab workspace; return the notebook panel's locator."""
    page.goto(f"{lab['url']}/lab/tree/{path}?token={lab['token']}&reset")
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    expect(panel.locator(".jp-Cell").first).to_be_visible()
    return panel


def _wait_for_idle_kernel(page: Page, panel) -> None:
    """The notebook's kernel is Python 3 and idle (toolbar indicator and status bar agree)."""
    expect(panel.locator(".jp-KernelName")).to_have_text("Python 3 (ipykernel)", timeout=KERNEL_IDLE_MS)
    expect(panel.locator(".jp-Notebook-ExecutionIndicator")).to_have_attribute(
        "data-status", "idle", timeout=KERNEL_IDLE_MS)
    expect(page.locator(".jp-StatusBar-Widget")).to_contain_text(["| Idle"], timeout=KERNEL_IDLE_MS)


def _open_menu(page: Page, menu: str):
    """Click ``menu`` in the top menu bar; return the labels of its items."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(f"^{re.escape(menu)}$")).click()
    return page.locator(".lm-Menu:visible .lm-Menu-itemLabel")


def _menu(page: Page, menu: str, item: str) -> None:
    """Click ``menu`` in the top menu bar, then ``item`` in it."""
    _open_menu(page, menu).filter(has_text=re.compile(f"^{re.escape(item)}$")).click()


def _run_all_cells(page: Page, panel, code_cells: int):
    """Run > Run All Cells; wait until no cell is running or queued ([*]) and the kernel is idle.

    Returns the code cells' prompts. (After an error JupyterLab drops the queued cells, so
    waiting for "[*]" to go away does not wait for cells that will never run.)
    """
    prompts = panel.locator(".jp-CodeCell .jp-InputArea-prompt")
    expect(prompts).to_have_count(code_cells)
    running = prompts.filter(has_text="[*]")
    _menu(page, "Run", "Run All Cells")
    expect(running.first).to_be_attached()  # the run has started
    expect(running).to_have_count(0, timeout=RUN_ALL_MS)
    expect(panel.locator(".jp-Notebook-ExecutionIndicator")).to_have_attribute("data-status", "idle")
    return prompts


def _assert_no_error_output(panel) -> None:
    """No stderr/error output and no traceback anywhere in the notebook; the pins are all ✓."""
    # text_content, not inner_text: cells scrolled out of view are not rendered (content-visibility)
    outputs = panel.locator(".jp-Cell .jp-OutputArea-output")
    errors = panel.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    assert errors.count() == 0, "error output in the notebook:\n" + "\n---\n".join(errors.all_text_contents())
    texts = outputs.all_text_contents()
    failed = [t for t in texts if "Traceback" in t or re.search(r"^\w*(Error|Exception)\b", t, re.MULTILINE)]
    assert not failed, f"an error in the outputs: {failed}"
    environment = outputs.filter(has_text="torch ").first.text_content()
    assert "✗" not in environment and environment.count("✓") >= 2, environment


def _assert_figure_rendered(panel) -> None:
    """The matplotlib figure of section 3 is a loaded PNG image in an output area."""
    figure = panel.locator('.jp-OutputArea-output[data-mime-type="image/png"] img').first
    figure.scroll_into_view_if_needed()
    expect(figure).to_be_visible()
    assert figure.evaluate("img => img.complete && img.naturalWidth > 200 && img.naturalHeight > 100")


def _explorer_line(output) -> tuple[float, float]:
    """(T, p(mat)) from the explorer's printed line."""
    text = output.text_content()
    match = EXPLORER_LINE.match(text)
    assert match, f"unexpected explorer output: {text!r}"
    return float(match.group(1)), float(match.group(2))


def _p_mat(temperature: float) -> float:
    """softmax(SCORES / T)[0], what the explorer should print for "mat"."""
    weights = [math.exp(s / temperature) for s in SCORES]
    return weights[0] / sum(weights)


def _move_slider(handle, key: str, presses: int) -> None:
    """Focus the slider handle and press an arrow key, as a keyboard user does."""
    handle.focus()
    for _ in range(presses):
        handle.press(key)


# --------------------------------------------------------------------------- the tests


def test_orientation_runs_and_its_widget_responds(page, lab):
    """Chapter 00 in JupyterLab: run all cells, no error, a figure, a working temperature slider."""
    notebook = json.loads((lab["root"] / ORIENTATION).read_text())
    code_cells = sum(cell["cell_type"] == "code" for cell in notebook["cells"])
    with _screenshot_on_failure(page, "orientation"):
        panel = _open_notebook(page, lab, ORIENTATION)
        _wait_for_idle_kernel(page, panel)
        prompts = _run_all_cells(page, panel, code_cells)
        _assert_no_error_output(panel)
        # every code cell ran once, top to bottom, in this fresh kernel
        expect(prompts).to_have_text([f"[{n}]:" for n in range(1, code_cells + 1)])
        _assert_figure_rendered(panel)
        _screenshot(page, "01-orientation-after-run-all")

        explorer = panel.locator(".jupyter-widgets.widget-vbox").filter(has=page.locator(".widget-slider"))
        expect(explorer).to_have_count(1)
        expect(explorer.locator(".widget-label")).to_have_text("temperature")
        line = explorer.locator(".widget-output .jp-OutputArea-output").first
        chart = explorer.locator('.widget-output [data-mime-type="image/png"] img')
        readout = explorer.locator(".widget-readout")
        handle = explorer.locator(".noUi-handle")
        handle.scroll_into_view_if_needed()
        expect(line).to_have_text(re.compile(r"^T = 1\.00 → p\(mat\) = 0\.609"))
        expect(chart).to_be_visible()
        chart_before = chart.get_attribute("src")

        _move_slider(handle, "ArrowRight", 3)  # three steps of 0.05 in log10(T): T = 10**0.15
        expect(readout).not_to_have_text("1.00")
        # the kernel redraws once per step: wait for the line of the value the slider shows now
        expect(line).to_have_text(re.compile(rf"^T = {re.escape(readout.text_content())} → "))
        temperature, p_mat = _explorer_line(line)
        assert temperature > 1.0, temperature
        assert p_mat == pytest.approx(_p_mat(temperature), abs=2e-3), (temperature, p_mat)
        assert p_mat < 0.609, "a higher temperature must flatten the distribution"
        expect(chart).not_to_have_attribute("src", chart_before or "")
        _screenshot(page, "02-orientation-slider-moved")

        _move_slider(handle, "ArrowLeft", 3)
        expect(line).to_have_text(re.compile(r"^T = 1\.00 → p\(mat\) = 0\.609"))


GRADED = {"tests", "manual", "task"}  # the nbgrader cell types that carry points


def _expected_nbgrader_cells(notebook: dict) -> list[tuple[str, str, str]]:
    """(type, grade id, points) the Create Assignment panel should show, in notebook order."""
    def cell_type(meta: dict) -> str:
        if meta.get("task"):
            return "task"
        if meta.get("solution") and meta.get("grade"):
            return "manual"
        if meta.get("solution"):
            return "solution"
        if meta.get("grade"):
            return "tests"
        return "readonly" if meta.get("locked") else ""

    rows = []
    for cell in notebook["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        kind = cell_type(meta)
        if kind:
            rows.append((kind, meta["grade_id"], str(meta.get("points", 0)) if kind in GRADED else ""))
    return rows


def test_nbgrader_extension_on_a_solution_notebook(page, lab):
    """solutions/01: the Nbgrader menu, the Validate button and the Create Assignment panel."""
    notebook = json.loads((lab["root"] / SOLUTION).read_text())
    expected = _expected_nbgrader_cells(notebook)
    assert expected, f"{SOLUTION} has no nbgrader cells"
    with _screenshot_on_failure(page, "nbgrader"):
        panel = _open_notebook(page, lab, SOLUTION)
        expect(panel.locator(".jp-Toolbar").get_by_text("Validate", exact=True)).to_be_visible()

        items = _open_menu(page, "Nbgrader")
        # a "Formgrader (local)" item may come too (nbgrader_config.py is in the server's folder)
        expect(items).to_contain_text(["Assignment List", "Course List", "Formgrader", "Create assignment"])
        _screenshot(page, "03-nbgrader-menu")
        items.filter(has_text=re.compile("^Create assignment$")).click()

        sidebar = page.locator(".nbgrader-CreateAssignmentWidget")
        expect(sidebar).to_be_visible()
        expect(sidebar.locator(".nbgrader-CellWidget")).to_have_count(len(notebook["cells"]))
        total = sum(int(points) for kind, _, points in expected if kind in GRADED)
        expect(sidebar.locator(".nbgrader-TotalPointsInput")).to_have_value(str(total))
        shown = sidebar.locator(".nbgrader-CellWidget").evaluate_all("""cells => cells
            .map(cell => [cell.querySelector('.nbgrader-CellType select').value,
                          cell.querySelector('.nbgrader-CellId input').value,
                          cell.querySelector('.nbgrader-CellPoints input').value])
            .filter(([type]) => type !== '')""")
        # the panel shows "0" points for cells that carry none (answers, read-only cells)
        assert [(kind, grade_id, points if kind in GRADED else "") for kind, grade_id, points in shown] == expected

        # select the first answer cell in the notebook: the panel marks the same cell as active
        first_id = next(grade_id for kind, grade_id, _ in expected if kind == "solution")
        answer = panel.locator(".jp-CodeCell").filter(has_text="### BEGIN SOLUTION").first
        answer.scroll_into_view_if_needed()
        answer.locator(".jp-InputPrompt").click()
        active = sidebar.locator(".nbgrader-CellWidget.nbgrader-mod-active")
        expect(active.locator(".nbgrader-CellId input")).to_have_value(first_id)
        active.scroll_into_view_if_needed()
        _screenshot(page, "04-nbgrader-create-assignment")
