# Two commands on a fresh machine: `make demo` and `make test`. Each creates or updates .venv itself.
# `make serve`: local Prefect + MLflow servers, a CPU worker and its deployments (deploy/README.md); Ctrl-C stops.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= demo-output
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120

.PHONY: slurm venv lock lock-check test lint format demo bench gpu-check clean serve browser

# The whole environment, transitive packages included, is pinned in $(LOCK) (`make lock` writes it from pyproject.toml;
# docs/reference/pins.md#the-lock-file). Re-sync only when pyproject.toml or the lock changes; `pip install -e` keeps
# source edits live. uv (pinned in the dev extra) installs the lock; where uv cannot be installed, pip does.
LOCK := requirements.lock
UV_PIN := $(shell sed -n 's/^ *"\(uv==[^"]*\)".*/\1/p' pyproject.toml)
# Where the CPU torch wheel (torch==2.13.0+cpu) lies on this kind of machine; `make lock` records it in the lock.
TORCH_WHEELS ?= /opt/wheels
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --extra dev --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --find-links $(TORCH_WHEELS) --emit-find-links --generate-hashes \
	--custom-compile-command "make lock" --quiet

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install -q "$(UV_PIN)" \
		|| echo "uv could not be installed: pip installs $(LOCK) instead" >&2
	if test -x $(BIN)/uv && $(BIN)/uv pip sync -q --compile-bytecode --python $(BIN)/python $(LOCK); then :; \
	elif $(BIN)/python -m pip install -q --require-hashes --no-deps -r $(LOCK); then :; \
	else echo "WARNING: $(LOCK) could not be installed here (is the CPU torch wheel in $(TORCH_WHEELS)?):" \
		"pip resolves pyproject.toml instead" >&2; $(BIN)/python -m pip install -q -e ".[dev]"; fi
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

venv: $(STAMP)

$(BIN)/uv:
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(UV_PIN)"

# Re-resolve pyproject.toml into $(LOCK), keeping every locked version that still fits (LOCK_ARGS=--upgrade moves
# everything to the newest releases; LOCK_ARGS="--upgrade-package NAME" one package). Then `make venv` syncs to it.
lock: $(BIN)/uv
	$(UV_COMPILE) $(LOCK_ARGS) -o $(LOCK)

# Fails when $(LOCK) no longer matches pyproject.toml (a pin changed without `make lock`). Needs the package index.
lock-check: venv
	@cp $(LOCK) $(VENV)/lock-check.txt
	@$(UV_COMPILE) -o $(VENV)/lock-check.txt
	@grep -E '^[^ #]' $(LOCK) > $(VENV)/lock-pins.old; grep -E '^[^ #]' $(VENV)/lock-check.txt > $(VENV)/lock-pins.new
	@diff -u $(VENV)/lock-pins.old $(VENV)/lock-pins.new \
		|| { echo "$(LOCK) does not match pyproject.toml: run 'make lock' and commit the lock" >&2; exit 1; }
	@echo "$(LOCK) matches pyproject.toml"

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
	$(BIN)/wsidino-dev samples $(DEMO_DIR)/slides --preset demo --no-negatives
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
