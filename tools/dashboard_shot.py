"""Screenshots of the live page (/dashboard) from a headless chromium, and a way to show a GPU host's
figures on a machine that has a browser: the GPU host has none (and no network).

    # on the GPU host: bash tools/gpu_check.sh dashboard (a server on the GPU, driven, then captured), or
    # against any running server (drive: 20 s of requests of 1-32 rows from 8 threads, then capture):
    python tools/dashboard_shot.py drive --url http://127.0.0.1:8000 --out bench/results
    # here (Debian: apt-get install chromium chromium-driver), the page drawn from that capture:
    python tools/dashboard_shot.py replay bench/results/dashboard.jsonl:2 docs/dashboard_h200.png

A capture goes to ``OUT/dashboard.jsonl`` as one line (``bench/runs.py``: the GPU, the commit, and
the /model-stats and /kernel-stats JSON), or to one JSON file where ``--out`` ends in ``.json``.
``replay`` serves the package's own page and assets beside the captured JSON on a loopback port, so
the picture is the real page showing the GPU run."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench import runs  # noqa: E402

WIDTH = 1280


def browser_paths() -> tuple[str | None, str | None]:
    """The chromium binary and its chromedriver, or None for what is missing."""
    return (shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome"),
            shutil.which("chromedriver"))


def chrome(height: int = 1000):
    """A headless chromium driven through the system's chromedriver (Selenium Manager, which would
    download drivers, is never asked: both paths are given). Keeps the browser's console log."""
    from selenium import webdriver

    binary, driver = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WIDTH},{height}", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


def full_page_png(driver, path: Path) -> Path:
    """Resize the window to the page's height, then save a PNG of all of it."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WIDTH, min(max(height + 20, 600), 6000))
    time.sleep(0.3)  # one frame to lay out at the new size
    path.parent.mkdir(parents=True, exist_ok=True)
    if not driver.save_screenshot(str(path)):
        raise RuntimeError(f"chromium did not write {path}")
    return path


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def capture(url: str, out: Path) -> dict:
    """Both JSON routes the page reads, once, with when and where they were read: a line of
    ``out/dashboard.jsonl``, or the file ``out`` where it ends in ``.json``."""
    url = url.rstrip("/")
    data = {"captured_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "url": url,
            "model_stats": _get(url + "/model-stats"), "kernel_stats": _get(url + "/kernel-stats")}
    if out.suffix == ".json":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        return data
    return runs.Run("dashboard", out, gpu=_gpu()).save([], None, **data)


def _gpu() -> str | None:
    """The first GPU's name where nvidia-smi answers (the server under capture runs on it)."""
    import subprocess

    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    return names[0].strip() or None


def drive(url: str, seconds: float, out: Path, clients: int = 8) -> dict:
    """Requests of 1 to 32 rows to every served model from ``clients`` threads for ``seconds``, and a
    few the server refuses (so errors by status show), after a reset; then ``capture``."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    url = url.rstrip("/")
    widths = {name: m["in_features"] for name, m in _get(url + "/model-stats")["models"].items()}
    httpx.post(url + "/kernel-stats/reset", timeout=10).raise_for_status()
    end = time.monotonic() + seconds

    def client(seed: int) -> int:
        rng, sent = random.Random(seed), 0
        with httpx.Client(base_url=url, timeout=30) as c:
            while time.monotonic() < end:
                name = rng.choice(sorted(widths))
                rows = rng.choice((1, 1, 1, 2, 3, 4, 8, 13, 16, 32))
                c.post("/infer", json={"model": name, "inputs": [[rng.random() for _ in range(widths[name])]] * rows})
                sent += 1
        return sent

    with ThreadPoolExecutor(clients) as pool:
        sent = sum(pool.map(client, range(clients)))
    with httpx.Client(base_url=url, timeout=30) as c:
        for name in sorted(widths):  # a row of the wrong width: 422
            c.post("/infer", json={"model": name, "inputs": [[0.0] * (widths[name] + 1)]})
    print(f"drive: {sent} requests in {seconds} s to {sorted(widths)}")
    return capture(url, out)


def _replay_handler(data: dict):
    from fusedserve.service.http.routes.dashboard import ASSETS, asset

    routes = {"/model-stats": json.dumps(data["model_stats"]).encode(),
              "/kernel-stats": json.dumps(data["kernel_stats"]).encode()}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            name = "index.html" if self.path == "/dashboard" else self.path.removeprefix("/dashboard/")
            if self.path in routes:
                body, media = routes[self.path], "application/json"
            elif name in ASSETS and (name != "index.html" or self.path == "/dashboard"):
                body, media = asset(name), ASSETS[name]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    return Handler


def replay(capture_path: Path | str, png: Path, driver=None) -> Path:
    """Draw the page from a capture (``dashboard.jsonl:LINE`` or a ``.json``) in chromium (``driver``,
    or a new one) and save ``png``."""
    data = runs.pick(capture_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadingHTTPServer(("127.0.0.1", port), _replay_handler(data))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    own = driver is None
    driver = chrome() if own else driver
    try:
        driver.get(f"http://127.0.0.1:{port}/dashboard")
        end = time.monotonic() + 20
        while not driver.find_elements("css selector", "section.model") and time.monotonic() < end:
            time.sleep(0.1)
        driver.execute_script("document.getElementById('pause').click();"  # freeze what is drawn
                              "document.getElementById('status').textContent = arguments[0];",
                              f"figures captured {data['captured_utc']} from {data['url']} (replayed)")
        return full_page_png(driver, png)
    finally:
        if own:
            driver.quit()
        server.shutdown()


def main() -> None:
    top = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capture", help="save a running server's /model-stats and /kernel-stats")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--out", type=Path, default=runs.RESULTS, help="folder of dashboard.jsonl, or a .json file")
    d = sub.add_parser("drive", help="reset, send requests for --seconds, then capture")
    d.add_argument("--url", default="http://127.0.0.1:8000")
    d.add_argument("--seconds", type=float, default=20.0)
    d.add_argument("--out", type=Path, default=runs.RESULTS, help="folder of dashboard.jsonl, or a .json file")
    r = sub.add_parser("replay", help="draw a capture in chromium and save a PNG")
    r.add_argument("capture", help="dashboard.jsonl:LINE, or a .json capture")
    r.add_argument("png", type=Path)
    args = top.parse_args()
    if args.command in ("capture", "drive"):
        data = capture(args.url, args.out) if args.command == "capture" else drive(args.url, args.seconds, args.out)
        print(f"{args.out}: {sorted(data['model_stats']['models'])} at {data['captured_utc']}")
    else:
        print(replay(args.capture, args.png))


if __name__ == "__main__":
    main()
