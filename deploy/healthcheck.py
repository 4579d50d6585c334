"""The container's HEALTHCHECK: exit 0 once GET /v2/health/ready answers 200 on the host and port that
``fusedserve serve`` reads from FUSEDSERVE_HOST and FUSEDSERVE_PORT, else exit 1 saying why."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

from fusedserve.service.settings import Settings

# A server bound to every interface answers on loopback.
_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def ready_url(env: Mapping[str, str]) -> str:
    fields = Settings.model_fields
    host = env.get("FUSEDSERVE_HOST", fields["host"].default)
    port = env.get("FUSEDSERVE_PORT", fields["port"].default)
    host = _WILDCARDS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v2/health/ready"


def main() -> int:
    url = ready_url(os.environ)
    try:
        with urllib.request.urlopen(url, timeout=2):
            return 0
    except (urllib.error.URLError, OSError) as exc:  # HTTPError (503 while warming up) is a URLError
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
