"""The dashboard in a real browser: Playwright driving Debian's Chromium (headless) against the dashboard on
127.0.0.1 over a real run. The pages load, charts hold data points, a trajectory opens with its parallel calls, diff,
hints and monitor flags, what the model wrote stays text, and new metrics lines appear without a reload.

Screenshots of each page go to $SHIPYARD_DASHBOARD_SHOTS when set (docs/img/dashboard-*.png were taken so), else
to the test's temporary directory. Without Playwright or Chromium the tests skip — unless $SHIPYARD_REQUIRE_BROWSER
is set (CI sets it: there they must run)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from servers import running_app

from shipyard.dashboard.app import create_app

TOKEN = "dashboard-browser-token"
CHROMIUM = os.environ.get("SHIPYARD_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if CHROMIUM is None:
        return "no Chromium (apt-get install chromium, or set $SHIPYARD_CHROMIUM)"
    return None


_why = _missing()
if _why is not None and os.environ.get("SHIPYARD_REQUIRE_BROWSER"):
    raise RuntimeError(f"$SHIPYARD_REQUIRE_BROWSER is set but {_why}")
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: Chromium's own sandbox needs user namespaces or a setuid helper; the page is our own, on
        # loopback, and the test's data is trusted only as far as the tests below check.
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    out = Path(os.environ.get("SHIPYARD_DASHBOARD_SHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def open_page(browser, url: str, tab: str = "curves"):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/#token={TOKEN}")  # the printed link: the token in the fragment, kept in sessionStorage
    if tab != "curves":
        page.click(f"#tabs button[data-page={tab}]")
    return page, errors


def points(page, title: str) -> int:
    return int(page.get_attribute(f'.chart[data-title="{title}"]', "data-points") or 0)


def until(page, predicate, timeout: float = 15.0) -> bool:
    """Poll `predicate()` from Python (the page's CSP forbids the eval that `wait_for_function` needs)."""
    for _ in range(int(timeout * 10)):
        if predicate():
            return True
        page.wait_for_timeout(100)
    return False


def rows(page) -> int:
    return page.locator("#rollouts tr.rollout").count()


def open_rollout(page, step: int, position: int) -> None:
    """On the trajectories page: list the step's rollouts (the filter), open one, wait for its turns."""
    page.wait_for_selector("#rollouts tr.rollout")
    page.select_option('#filters select[name="step"]', str(step))
    assert until(page, lambda: {int(s) for s in page.locator("#rollouts tr.rollout").evaluate_all(
        "rows => rows.map(r => r.dataset.step)")} == {step})
    page.locator(f'#rollouts tr.rollout[data-position="{position}"]').click()
    page.wait_for_selector("#viewer section.turn")


def test_training_curves_hold_data_points(browser, dash_run, shots):
    with running_app(create_app(dash_run.parent, token=TOKEN)) as url:
        page, errors = open_page(browser, url)
        page.wait_for_selector('.chart[data-title="reward"] circle.point')
        assert points(page, "reward") >= 4  # reward/mean and pass_rate, two steps each
        assert points(page, "held-out eval") >= 3 and points(page, "hints") >= 2 and points(page, "grad norm") == 2
        assert "finished" in page.inner_text("#run-summary")
        assert "token" not in page.url  # moved out of the address bar (and history) into sessionStorage
        page.reload()
        page.wait_for_selector('.chart[data-title="reward"] circle.point')  # still signed in, in this tab
        page.screenshot(path=str(shots / "dashboard-training.png"), full_page=True)
        assert errors == []


def test_a_trajectory_opens_with_parallel_calls_diff_hints_and_flags(browser, dash_run, shots):
    with running_app(create_app(dash_run.parent, token=TOKEN)) as url:
        page, errors = open_page(browser, url, "trajectories")
        page.wait_for_selector("#rollouts tr.rollout")
        assert rows(page) == 4
        open_rollout(page, 1, 0)
        page.wait_for_selector("#viewer pre.diff span.add")
        viewer = page.locator("#viewer")
        assert "+# pocketlib (checked)" in viewer.locator("pre.diff").last.inner_text()
        assert viewer.locator(".flags .flag").count() >= 1
        assert viewer.locator(".hint").count() == 2
        assert max(t.locator(".call").count() for t in viewer.locator("section.turn").all()) == 2
        page.screenshot(path=str(shots / "dashboard-trajectory.png"), full_page=True)
        assert errors == []


def test_evals_side_by_side_and_the_task_browser(browser, dash_run, shots):
    with running_app(create_app(dash_run.parent, token=TOKEN)) as url:
        page, errors = open_page(browser, url, "evals")
        page.wait_for_selector("#eval-table tr.overall")
        assert page.input_value("#eval-a").endswith("step-000000")
        assert page.input_value("#eval-b").endswith("step-000002")
        assert "pass@1" in page.inner_text("#eval-table")
        page.screenshot(path=str(shots / "dashboard-evals.png"), full_page=True)
        page.click("#tabs button[data-page=tasks]")
        page.wait_for_selector("#task-list tr.task")
        assert page.locator("#task-list tr.task").count() == 3
        page.locator("#task-list tr.task").first.click()
        page.wait_for_selector("#task-view details")
        assert "NotImplementedError" in page.inner_text("#task-view") and "tests/" in page.inner_text("#task-view")
        page.screenshot(path=str(shots / "dashboard-tasks.png"), full_page=True)
        assert errors == []


def test_the_fleet_page_shows_the_environment_server_live(browser, dash_run, shots, repo, monkeypatch):
    from shipyard.sandbox.client import EnvClient
    from shipyard.sandbox.server import ServerConfig
    from shipyard.sandbox.server import create_app as env_app

    token = "env-token-of-sixteen-chars"
    with running_app(env_app(ServerConfig(token=token, allowed_roots=(repo.parent,)))) as env_url:
        monkeypatch.setenv("SHIPYARD_ENV_TOKEN", token)
        with running_app(create_app(dash_run.parent, token=TOKEN, env_server=env_url)) as url:
            page, errors = open_page(browser, url, "fleet")
            page.wait_for_selector("#fleet-cards .card")
            assert "live sandboxes" in page.inner_text("#fleet-cards")
            client = EnvClient(env_url, token=token)
            sandbox = client.sandbox(client.snapshot(str(repo)))
            try:
                live = lambda: page.locator("#fleet-cards .card .value").first.inner_text() == "1"  # noqa: E731
                assert until(page, live)  # a sandbox started after the page opened shows up on its own
                assert until(page, lambda: points(page, "create latency ms") >= 2)
                page.screenshot(path=str(shots / "dashboard-fleet.png"), full_page=True)
            finally:
                sandbox.close()
                client.close()
            assert errors == []


def test_new_metrics_appear_without_a_reload(browser, run_copy):
    with running_app(create_app(run_copy.parent, token=TOKEN)) as url:
        page, errors = open_page(browser, url)
        page.wait_for_selector('.chart[data-title="reward"] circle.point')
        before = points(page, "reward")
        with (run_copy / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 3, "time": 0, "reward/mean": 0.5, "reward/pass_rate": 0.5}) + "\n")
        assert until(page, lambda: points(page, "reward") == before + 2)
        assert errors == []


def test_what_the_model_wrote_is_shown_as_text_never_run(browser, run_copy):
    """A turn's text, a tool output and a hint holding markup and script reach the page as literal text."""
    payload = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
    path = run_copy / "trajectories" / "step-000001.jsonl"
    lines = path.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["trajectory"]["turns"][0]["text"] = payload
    rec["trajectory"]["turns"][0]["calls"][0]["output"] = payload
    rec["hints"][0]["text"] = payload
    rec["trajectory"]["patch"] = f"+++ b/x\n+{payload}\n"
    path.write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    with running_app(create_app(run_copy.parent, token=TOKEN)) as url:
        page, errors = open_page(browser, url, "trajectories")
        open_rollout(page, 1, 0)
        assert page.evaluate("window.pwned") is None
        assert page.locator("#viewer img").count() == 0 and page.locator("#viewer script").count() == 0
        assert page.inner_text("#viewer").count(payload) >= 3
        assert errors == []
