"""The web UI in a real browser (Debian's chromium driven by Playwright), against a `sluice server`
with two workers and user accounts (tests/clients.rs starts it): the UI asks for a login and keeps
its session in a cookie the page cannot read, the job list shows TPC-H q5 appear and finish, its
page draws every stage of its job graph and every task attempt on the timeline, and the cancel
button stops a long query, whose client then sees it cancelled. Screenshots of the job list and the
job page go to SLUICE_SCREENSHOTS. Exits non-zero with the failed check's message."""

import base64
import json
import os
import threading
import urllib.request

import adbc_driver_flightsql.dbapi as flight_sql
from playwright.sync_api import expect, sync_playwright

HTTP = os.environ["SLUICE_HTTP"]
FLIGHT_SQL = os.environ["SLUICE_FLIGHT_SQL"]
QUERIES = os.environ["SLUICE_TPCH_QUERIES"]
SHOTS = os.environ["SLUICE_SCREENSHOTS"]
CHROMIUM = os.environ.get("SLUICE_CHROMIUM", "/usr/bin/chromium")
USER = os.environ["SLUICE_UI_USER"]
PASSWORD = os.environ["SLUICE_UI_PASSWORD"]
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
LONG_QUERY = "select count(distinct value % 1000003) from generate_series(1, 5000000000)"
# This machine has no network beyond loopback: keep chromium from reaching for it.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def api(path):
    request = urllib.request.Request(f"http://{HTTP}{path}", headers={"Authorization": BASIC})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def run(sql):
    credentials = {"username": USER, "password": PASSWORD}
    with flight_sql.connect(FLIGHT_SQL, db_kwargs=credentials) as conn, conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def main():
    os.makedirs(SHOTS, exist_ok=True)
    with open(os.path.join(QUERIES, "q05.sql")) as f:
        q5 = f.read().strip().rstrip(";")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://{HTTP}/")
        # The server has accounts: the UI shows its login form, then the jobs.
        expect(page.locator("form#login")).to_be_visible()
        page.fill('input[name="user"]', USER)
        page.fill('input[name="password"]', "wrong")
        page.click('form#login button[type="submit"]')
        expect(page.locator("#login-error")).to_have_text(f"wrong user name or password for '{USER}'")
        page.fill('input[name="password"]', PASSWORD)
        page.click('form#login button[type="submit"]')
        expect(page.locator("#jobs")).to_be_visible()
        cookies = {c["name"]: c for c in page.context.cookies()}
        assert cookies["sluice_token"]["httpOnly"] and cookies["sluice_token"]["sameSite"] == "Strict", cookies
        assert page.evaluate("document.cookie") == "", "the page can read the session cookie"
        before = {job["id"] for job in api("/api/v1/jobs")}

        # q5 appears in the list and finishes there.
        rows = run(q5)
        assert len(rows) == 5, rows
        jobs = [job for job in api("/api/v1/jobs") if job["id"] not in before]
        assert len(jobs) == 1, jobs
        job = jobs[0]
        assert job["state"] == "succeeded" and job["rows"] == 5, job
        row = page.locator(f'tr.job[data-job="{job["id"]}"]')
        expect(row).to_have_attribute("data-state", "succeeded", timeout=10_000)
        expect(row).to_contain_text(f'{job["tasks"]}/{job["tasks"]}')
        page.screenshot(path=os.path.join(SHOTS, "jobs.png"), full_page=True)

        # Its page: every stage of the job graph, every task attempt on the timeline.
        row.locator("a").click()
        detail = api(f'/api/v1/jobs/{job["id"]}')
        expect(page.locator("#job-state")).to_have_text("succeeded")
        stages = page.locator("svg.dag g.stage")
        expect(stages).to_have_count(len(detail["graph"]))
        drawn = sorted(int(s) for s in stages.evaluate_all("els => els.map(e => e.dataset.stage)"))
        assert drawn == list(range(job["stages"])), drawn
        edges = sum(len(stage["inputs"]) for stage in detail["graph"])
        expect(page.locator("svg.dag path.edge")).to_have_count(edges)
        bars = page.locator("svg.timeline rect.attempt")
        expect(bars).to_have_count(len(detail["attempts"]))
        tasks = bars.evaluate_all(
            "els => els.map(e => [Number(e.dataset.stage), Number(e.dataset.partition)])")
        expected = sorted([a["stage"], a["partition"]] for a in detail["attempts"])
        assert sorted(tasks) == expected, (tasks, expected)
        assert len({tuple(t) for t in tasks}) == job["tasks"], tasks
        expect(page.locator("#skew tbody tr")).to_have_count(job["stages"])
        page.screenshot(path=os.path.join(SHOTS, "job.png"), full_page=True)

        # A long query, cancelled with the button on its page.
        outcome = {}

        def long_query():
            try:
                run(LONG_QUERY)
                outcome["error"] = None
            except Exception as error:  # the cancel ends it with an error
                outcome["error"] = str(error)

        client = threading.Thread(target=long_query)
        client.start()
        page.goto(f"http://{HTTP}/")
        running = page.locator('tr.job[data-state="running"]')
        expect(running).to_have_count(1, timeout=30_000)
        running.locator("a").click()
        expect(page.locator("#job-state")).to_have_text("running")
        page.locator("#cancel").click()
        expect(page.locator("#job-state")).to_have_text("cancelled", timeout=10_000)
        client.join(timeout=30)
        assert not client.is_alive(), "the cancelled query's client never returned"
        assert outcome["error"] and "was cancelled (REST API)" in outcome["error"], outcome
        browser.close()
    print("ui ok")


if __name__ == "__main__":
    main()
