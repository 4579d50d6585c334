"""Moved to ``tools/dashboard_shot.py``. This name stays only until tests/service/test_dashboard_browser.py
imports from there (tests/service is another change's); then delete this file."""

from tools.dashboard_shot import browser_paths, capture, chrome, full_page_png, replay  # noqa: F401
