# Two commands on a fresh machine: `make demo` and `make test`. Each creates or updates .venv itself.
# `make serve`: local Prefect + MLflow servers and a worker with every deployment (deploy/README.md); Ctrl-C stops.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= demo-output
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120

.PHONY: slurm venv test lint format demo bench gpu-check clean serve browser

# Reinstall only when pyproject.toml changes; `pip install -e` keeps source edits live.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: venv lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The README's "On your own slides" command, on sample slides written from real tissue images (no download).
demo: venv
	$(BIN)/wsidino-dev samples $(DEMO_DIR)/slides --preset demo --no-negatives > /dev/null
	$(BIN)/wsidino pipeline --slides $(DEMO_DIR)/slides --workdir $(DEMO_DIR) \
		--annotations $(DEMO_DIR)/slides/annotations --nproc-per-node 2

# SERVE_ARGS, e.g. SERVE_ARGS="--prefect-port 4300 --mlflow-port 5001 --serve-dir /tmp/wsidino-serve"
serve: venv
	$(BIN)/python -m wsidino_dev serve $(SERVE_ARGS)

# Debian's Chromium for the tests that open the Prefect and MLflow pages in a real headless browser
# (tests/browser.py; they skip without it). CI installs it; on a workstation it is optional.
browser:
	@command -v chromium >/dev/null || { SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

# Debian's SLURM and munge for the tests that submit to a real one-host cluster (tests/test_slurm.py starts one with
# wsidino_dev.slurm_local; they skip without these). CI installs them; on a workstation it is optional.
slurm:
	@{ command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null || { SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q slurm-wlm munge; }

bench: venv
	$(BIN)/python benchmarks/run_all.py --output bench-output

# One GPU: its tests, training and extraction throughput, memory estimate vs measured (docs/gpu-check.md).
gpu-check: venv
	$(BIN)/python benchmarks/gpu_check.py --output bench-output/gpu-check

clean:
	rm -rf $(DEMO_DIR) bench-output .pytest_cache .ruff_cache
