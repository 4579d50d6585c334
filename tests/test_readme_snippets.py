"""The README's snippets run as printed on a CPU machine: each python block, and each bash block that
talks to the server, runs against the shipped server with only its ports rewritten (8000 and 8001 become
free ones). Bash blocks that build, deploy or configure are named here with the test that covers them."""

import json
import re
import subprocess
import sys

import pytest

from .service.conftest import ROOT, Server

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.M | re.S)  # "" for a plain block (the layout)
# Commands a bash block may hold without being run here: make (CI runs `make test` from a fresh clone),
# export (keys: tests/service/test_security.py), docker and kubectl (tests/container, tests/deploy).
NOT_RUN_HERE = ("make", "export", "docker", "kubectl")


def _commands(block: str) -> list[str]:
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def _talks_to_server(language: str, block: str) -> bool:
    return language == "python" or (language == "bash" and all(c.startswith("curl ") for c in _commands(block)))


SNIPPETS = [(language, block) for language, block in BLOCKS if _talks_to_server(language, block)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(None, tmp_path_factory.mktemp("readme") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _run(language: str, block: str, server: Server, cwd) -> str:
    code = block.replace(":8000", f":{server.port}").replace(":8001", f":{server.grpc_port}")
    argv = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, f"README {language} snippet failed:\n{block}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_every_block_is_run_or_named():
    for language, block in BLOCKS:
        if (language, block) in SNIPPETS or language in ("", "text"):
            continue
        assert language == "bash", f"a {language} block the test neither runs nor names:\n{block}"
        others = [c for c in _commands(block) if c.split()[0] not in NOT_RUN_HERE]
        assert not others, f"README bash commands neither run here nor covered elsewhere: {others}"
    assert any(language == "python" for language, _ in SNIPPETS) and any(lang == "bash" for lang, _ in SNIPPETS)


def test_docker_run_publishes_both_ports():
    runs = [c for _, block in BLOCKS for c in _commands(block) if c.startswith("docker run")]
    assert runs, "the README no longer shows docker run"
    for command in runs:  # the gRPC snippet needs 8001 reachable from the host
        assert "-p 8000:8000" in command and "-p 8001:8001" in command, command


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs_against_the_shipped_server(index, server, tmp_path):
    language, block = SNIPPETS[index]
    stdout = _run(language, block, server, tmp_path)
    said = re.search(r"^# (\{.*\})$", block, re.M)
    if language == "bash" and said:  # the answer the README prints after the command: same keys, same class
        answer, printed = json.loads(stdout), said.group(1)
        assert sorted(answer) == sorted(re.findall(r'"(\w+)":', printed)), (stdout, printed)
        index_said = re.search(r"largest is at index (\d+)", printed)
        if index_said:
            logits = answer["outputs"][0]
            assert logits.index(max(logits)) == int(index_said.group(1)), (logits, printed)


def test_the_ready_line_is_logged_as_quoted(server):
    quoted = re.search(r"Once the server logs `([^`]+)`", README)
    assert quoted, "the quick start no longer says which line to wait for"
    line = " ".join(quoted.group(1).split())  # the quote may wrap in the README
    pattern = ".*".join(re.escape(part) for part in line.split("..."))
    assert re.search(pattern, server.log.read_text()), (quoted.group(1), server.log.read_text())
