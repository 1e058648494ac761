"""A fresh learner's first hour, in a real browser, on the JupyterLab that `course lab` starts.

The test starts JupyterLab with `course lab`'s own command line and environment (``course_lib.cli.lab_command``:
bound here to 127.0.0.1 with a random token and a free port, on a temporary folder holding *copies* of the released
notebooks of chapters 00 and 14 — JupyterLab autosaves; the generated notebooks/ must not change — with a PATH that
lacks the course's .venv/bin, a fresh HOME, and fresh user settings but for the terminal's screen reader mode, which
puts the terminal's text into the page for the test to read), drives headless Chromium with Playwright at
1440 x 900, and checks from the page itself that a learner

1. finds none of nbgrader's instructor tools: no Nbgrader menu, no Create Assignment panel, the formgrader and the
   exchange's pages are not served (nothing that rewrites notebooks/), no news pop-up; the Validate button is there;
2. runs all of chapter 00 without an error: the figure and the temperature explorer render, moving the slider
   changes the printed probabilities (checked against ``softmax(scores / T)``), its label is whole; after save,
   close, a kernel shut down and reopen, the slider is drawn again (no "Error displaying widget: model not found");
3. runs all of chapter 14 with nothing written: Run All reaches the last cell, each unfinished exercise's check says
   "... is not written yet" in a line or two, the course's version runs below, the plots are drawn;
4. writes a wrong online_softmax: its check is one short message, on screen without scrolling a traceback;
5. runs `course check 14` in a JupyterLab terminal and reads the report, whole messages included.

and, in a second server started as `course lab --instructor`, that the instructor's nbgrader is all there: the
Nbgrader menu, the formgrader, the Create Assignment panel with a solution notebook's grade ids and points.

Screenshots of each step, the server logs and the browser console are written to test-artifacts/browser/ (ignored
by git; emptied at the start of each run). The test is skipped, with the reason, when Playwright or the Debian
Chromium (/usr/bin/chromium) is missing.
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

from course_lib.cli import lab_command
from tests.helpers import ROOT

try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    pytest.skip("playwright is not installed (pip install -e . installs it)", allow_module_level=True)

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)")

ARTIFACTS = ROOT / "test-artifacts" / "browser"
ORIENTATION = "00-orientation/orientation.ipynb"
UNFINISHED = "14-tiled-attention/tiled_attention.ipynb"
SOLUTION = "solutions/01-attention/attention.ipynb"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--no-proxy-server"]
VIEWPORT = {"width": 1440, "height": 900}

SERVER_START_S = 60      # JupyterLab answering on /api
KERNEL_IDLE_MS = 60_000  # kernel started and idle
RUN_ALL_MS = 180_000     # every cell of a chapter executed
CHECK_MS = 240_000       # `course check 14` in the terminal
UI_MS = 30_000           # any other wait on the page
# What chapter 00's temperature explorer shows: softmax(SCORES / T) over LABELS.
SCORES = [2.0, 1.0, 0.5, -1.0]
EXPLORER_LINE = re.compile(r"^T = (\d+\.\d\d) → p\(mat\) = (\d\.\d{3}),")
# A learner's online_softmax with the classic bug: the running sum is not rescaled when the max grows.
WRONG_ONLINE_SOFTMAX = """def online_softmax(blocks):
    m = l = None
    for x in blocks:
        top = x.max(-1).values
        m = top if m is None else torch.maximum(m, top)
        s = torch.exp(x - m[..., None]).sum(-1)
        l = s if l is None else l + s
    return m, l"""
#: nbgrader's instructor tools by the names the lab shows them under, and where it shows them: the lab around the
#: documents (menus, side panels, tabs), not a notebook, whose prose may name them (chapter 00's does).
INSTRUCTOR_TOOLS = re.compile("Create Assignment|Formgrader|Assignment List|Course List", re.I)
LAB_CHROME = "#jp-menu-panel, #jp-top-panel, #jp-left-stack, #jp-right-stack, #jp-bottom-panel, .lm-TabBar, .lm-Menu"

# Pages of nbgrader's instructor tools and exchange: the formgrader's Generate rewrites notebooks/<chapter>/.
INSTRUCTOR_PAGES = ["/formgrader", "/formgrader/api/assignments", "/assignments", "/courses"]


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


def _prepare_root(tmp: Path, instructor: bool) -> Path:
    """The folder the server shows: copies of the released notebooks (a learner), or of a solution notebook and the
    nbgrader config in a folder laid out like the course (an instructor)."""
    root = tmp / ("course" if instructor else "notebooks")
    copies = {SOLUTION: SOLUTION, "nbgrader_config.py": "nbgrader_config.py"} if instructor else {
        f"notebooks/{path}": path for path in (ORIENTATION, UNFINISHED)}
    for source, target in copies.items():
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / source, root / target)
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


@contextmanager
def _course_lab(tmp: Path, instructor: bool = False):
    """`course lab` (or `course lab --instructor`) on a copy; yields its base URL, token and root folder.

    Its PATH lacks the interpreter's bin/ (`course lab` must add it), HOME and the Jupyter user folders are empty."""
    root = _prepare_root(tmp, instructor)
    port, token = _free_port(), secrets.token_hex(16)
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != bin_dir)
    (tmp / "home").mkdir()
    # the test reads the terminal's text: xterm draws on a canvas, and writes its rows into the page for screen readers
    terminal_settings = tmp / "lab-settings" / "@jupyterlab" / "terminal-extension" / "plugin.jupyterlab-settings"
    terminal_settings.parent.mkdir(parents=True)
    terminal_settings.write_text(json.dumps({"screenReaderMode": True}))
    environ = {**{k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "VIRTUAL_ENV"))},
               "PATH": path, "HOME": str(tmp / "home"), "SHELL": "/bin/bash", "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
    command, env = lab_command(instructor, ("--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
                                            "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
                                            "--LabApp.extension_manager=readonly",
                                            f"--LabApp.user_settings_dir={tmp / 'lab-settings'}",
                                            f"--LabApp.workspaces_dir={tmp / 'lab-workspaces'}"), environ, root)
    log = _artifact(f"jupyter-server{'-instructor' if instructor else ''}.log")
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_for_api(f"http://127.0.0.1:{port}/api", process, log, SERVER_START_S)
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "root": root}
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`course lab` as a learner starts it."""
    with _course_lab(tmp_path_factory.mktemp("lab")) as server:
        yield server


@pytest.fixture(scope="module")
def instructor_lab(tmp_path_factory):
    """`course lab --instructor`."""
    with _course_lab(tmp_path_factory.mktemp("instructor-lab"), instructor=True) as server:
        yield server


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
    context = browser.new_context(viewport=VIEWPORT)
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


def _code_cells(lab: dict, path: str) -> int:
    return sum(cell["cell_type"] == "code" for cell in json.loads((lab["root"] / path).read_text())["cells"])


def _save(page: Page, panel) -> None:
    """Ctrl+S, and wait until the tab no longer shows unsaved changes."""
    panel.locator(".jp-Notebook").click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    expect(page.locator(".lm-TabBar-tab.jp-mod-dirty")).to_have_count(0)


def _shut_down_kernels(page: Page, lab: dict) -> None:
    """What a restart of the server does to the widgets' models: gone from the kernel."""
    headers = {"Authorization": f"token {lab['token']}"}
    for kernel in page.request.get(f"{lab['url']}/api/kernels", headers=headers).json():
        assert page.request.delete(f"{lab['url']}/api/kernels/{kernel['id']}", headers=headers).status == 204


def test_1_the_learners_lab_has_no_instructor_tools(page, lab):
    """No Nbgrader menu, no Create Assignment panel, no formgrader or exchange pages, no news pop-up; Validate is there."""
    with _screenshot_on_failure(page, "learner-lab"):
        panel = _open_notebook(page, lab, ORIENTATION)
        opened = time.monotonic()
        expect(panel.locator(".jp-Toolbar").get_by_text("Validate", exact=True)).to_be_visible()
        menus = page.locator(".lm-MenuBar-item")
        expect(menus.filter(has_text="Run")).to_have_count(1)
        assert "Nbgrader" not in menus.all_text_contents(), menus.all_text_contents()
        expect(page.locator(".nbgrader-CreateAssignmentWidget")).to_have_count(0)
        expect(page.locator(LAB_CHROME).get_by_text(INSTRUCTOR_TOOLS)).to_have_count(0)
        for address in INSTRUCTOR_PAGES:
            response = page.request.get(f"{lab['url']}{address}?token={lab['token']}")
            assert response.status == 404, f"{address} answers {response.status} in the learner's lab"
        generate = page.request.post(f"{lab['url']}/formgrader/api/assignment/14-tiled-attention/generate",
                                     headers={"Authorization": f"token {lab['token']}"})
        assert generate.status == 404, generate.status
        # the news question came within a second of the page: what the checks above took counts toward it
        page.wait_for_timeout(max(0.0, 1000 * (1 - (time.monotonic() - opened))))
        expect(page.get_by_text(re.compile("official Jupyter news|notified", re.I))).to_have_count(0)
        _screenshot(page, "01-learner-lab-no-instructor-tools")


def test_2_orientation_runs_and_its_widget_responds_and_comes_back(page, lab):
    """Chapter 00: run all cells, no error, a figure, a working temperature slider with its whole label; saved,
    closed, its kernel gone and reopened, the slider is drawn from the saved state."""
    code_cells = _code_cells(lab, ORIENTATION)
    with _screenshot_on_failure(page, "orientation"):
        panel = _open_notebook(page, lab, ORIENTATION)
        _wait_for_idle_kernel(page, panel)
        prompts = _run_all_cells(page, panel, code_cells)
        _assert_no_error_output(panel)
        # every code cell ran once, top to bottom, in this fresh kernel
        expect(prompts).to_have_text([f"[{n}]:" for n in range(1, code_cells + 1)])
        _assert_figure_rendered(panel)
        _screenshot(page, "02-orientation-after-run-all")

        explorer = panel.locator(".jupyter-widgets.widget-vbox").filter(has=page.locator(".widget-slider"))
        expect(explorer).to_have_count(1)
        label = explorer.locator(".widget-label").first
        expect(label).to_have_text("temperature")
        assert label.evaluate("e => e.scrollWidth <= e.clientWidth"), "the slider's label is cut"
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
        _screenshot(page, "03-orientation-slider-moved")

        _move_slider(handle, "ArrowLeft", 3)
        expect(line).to_have_text(re.compile(r"^T = 1\.00 → p\(mat\) = 0\.609"))

        _save(page, panel)
        assert json.loads((lab["root"] / ORIENTATION).read_text())["metadata"].get("widgets"), "no widget state saved"
        _menu(page, "File", "Close Tab")
        expect(panel).to_have_count(0)
        _shut_down_kernels(page, lab)
        panel = _open_notebook(page, lab, ORIENTATION)
        explorer = panel.locator(".jupyter-widgets.widget-vbox").filter(has=page.locator(".widget-slider"))
        explorer.scroll_into_view_if_needed()
        expect(explorer.locator(".widget-label").first).to_have_text("temperature")
        expect(explorer.locator(".noUi-handle")).to_be_visible()
        expect(panel.get_by_text("Error displaying widget")).to_have_count(0)
        _screenshot(page, "04-orientation-reopened")


def test_3_run_all_reaches_the_end_of_an_unfinished_chapter_and_a_failed_check_is_one_message(page, lab):
    """Chapter 14 with nothing written: Run All runs every cell; each check says what is not written yet; the course's
    version runs below and draws. Then a wrong online_softmax: its check's message, whole and short, on screen."""
    code_cells = _code_cells(lab, UNFINISHED)
    with _screenshot_on_failure(page, "unfinished"):
        panel = _open_notebook(page, lab, UNFINISHED)
        _wait_for_idle_kernel(page, panel)
        prompts = _run_all_cells(page, panel, code_cells)
        expect(prompts).to_have_text([f"[{n}]:" for n in range(1, code_cells + 1)], timeout=RUN_ALL_MS)
        errors = panel.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        texts = errors.all_text_contents()
        assert len(texts) == 3, texts  # the three visible tests, nothing else
        for text in texts:
            assert re.match(r"^NotWrittenYet: \w+ is not written yet", text) and "Traceback" not in text, text
        outputs = " ".join(panel.locator(".jp-OutputArea-output").all_text_contents())
        assert "does not pass its check yet: the course's version runs below" in outputs
        assert panel.locator('.jp-OutputArea-output[data-mime-type="image/png"] img').count() >= 2
        errors.first.scroll_into_view_if_needed()
        expect(errors.first).to_be_visible()
        _screenshot(page, "05-unfinished-chapter-check-says-not-written-yet")
        last = panel.locator(".jp-CodeCell").last
        last.scroll_into_view_if_needed()
        expect(last.locator(".jp-InputArea-prompt")).to_be_visible()
        _screenshot(page, "06-unfinished-chapter-last-cell-ran")

        answer = panel.locator(".jp-CodeCell").filter(has_text="def online_softmax").first
        answer.scroll_into_view_if_needed()
        answer.locator(".cm-content").click()
        page.keyboard.press("Control+a")
        page.keyboard.insert_text(WRONG_ONLINE_SOFTMAX)
        page.keyboard.press("Shift+Enter")  # runs the answer, selects its visible test
        page.keyboard.press("Shift+Enter")  # runs the check
        check = panel.locator(".jp-CodeCell").filter(has_text="checks.check_online_softmax(online_softmax)")
        message = check.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        expect(message).to_contain_text("the running sum is not rescaled")
        text = message.text_content()
        assert text.startswith("CheckFailed: ") and "Traceback" not in text and "course_lib" not in text, text
        check.scroll_into_view_if_needed()
        box, height = message.bounding_box(), page.viewport_size["height"]
        assert box["height"] < 160 and 0 <= box["y"] and box["y"] + box["height"] <= height, box
        _screenshot(page, "07-a-failed-check-is-one-message")
        _save(page, panel)


def test_4_course_check_in_a_jupyterlab_terminal(page, lab):
    """File > New > Terminal, `course check 14`: the report, with the whole message of the failed check."""
    with _screenshot_on_failure(page, "terminal"):
        page.goto(f"{lab['url']}/lab?token={lab['token']}&reset")
        expect(page.locator(".lm-MenuBar-item").filter(has_text="File")).to_have_count(1)
        page.locator(".lm-MenuBar-item", has_text=re.compile("^File$")).click()
        page.locator(".lm-Menu:visible .lm-Menu-itemLabel", has_text=re.compile("^New$")).hover()
        page.locator(".lm-Menu:visible .lm-Menu-itemLabel", has_text=re.compile("^Terminal$")).click()
        terminal = page.locator(".jp-Terminal .xterm")
        expect(terminal).to_be_visible()
        terminal.click()
        page.keyboard.type("course check 14\n")
        rows = page.locator(".jp-Terminal .xterm-accessibility-tree")
        expect(rows).to_contain_text(re.compile(r"total\s+\d+\s/\s12"), timeout=CHECK_MS)  # xterm: no-break spaces
        shown = " ".join(rows.text_content().split())
        assert "command not found" not in shown, shown
        assert f"grading a copy of {lab['root'] / UNFINISHED}" in shown, shown  # the learner's notebook, saved
        assert "online_softmax-visible 0 / 1" in shown and "the running sum is not rescaled" in shown, shown
        assert "multiply it by exp(m_old - m_new)" in shown, "the message is cut: " + shown
        _screenshot(page, "08-course-check-in-a-terminal")


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


def test_5_the_instructors_lab_has_nbgrader(page, instructor_lab):
    """`course lab --instructor` on solutions/01: the formgrader, the Nbgrader menu, the Validate button and the Create
    Assignment panel."""
    lab = instructor_lab
    formgrader = page.request.get(f"{lab['url']}/formgrader?token={lab['token']}")
    assert formgrader.status == 200, formgrader.status
    notebook = json.loads((lab["root"] / SOLUTION).read_text())
    expected = _expected_nbgrader_cells(notebook)
    assert expected, f"{SOLUTION} has no nbgrader cells"
    with _screenshot_on_failure(page, "nbgrader"):
        panel = _open_notebook(page, lab, SOLUTION)
        expect(panel.locator(".jp-Toolbar").get_by_text("Validate", exact=True)).to_be_visible()

        items = _open_menu(page, "Nbgrader")
        # a "Formgrader (local)" item may come too (nbgrader_config.py is in the server's folder)
        expect(items).to_contain_text(["Assignment List", "Course List", "Formgrader", "Create assignment"])
        expect(page.locator(LAB_CHROME).get_by_text(INSTRUCTOR_TOOLS)).not_to_have_count(0)  # what the learner's lacks
        _screenshot(page, "09-instructor-nbgrader-menu")
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
        _screenshot(page, "10-instructor-create-assignment")
