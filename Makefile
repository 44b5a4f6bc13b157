# The two commands of the README: `make serve` and `make test`.
# Each creates the virtualenv and installs what it needs on a fresh machine.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# CPU build of torch (a local wheel on these machines); an unpinned torch pulls a CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: test test-fast test-faults serve demo lint deps install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The dependencies match the code (deptry; [tool.deptry] in pyproject.toml): first the package's and scripts'
# imports against the declared packages, none of the dev extra's among them; then the tests' imports as well.
deps: $(STAMP)
	$(VENV)/bin/deptry .
	$(VENV)/bin/deptry . -e '$(VENV)' -e '\.git' --ignore DEP002,DEP004

# Every test (CI runs this). The playground's browser test drives Debian's headless Chromium (installed here
# when missing). Two pytest-xdist workers (most tests run torch on one thread, so one process leaves a core idle);
# the Ray service tests are one group (tests/conftest.py), run on one worker that alone starts the Ray cluster.
# One OpenMP thread a process: the two workers, the processes tests start and the Ray cluster's replicas already
# fill the 2 cores, and two threads a process on oversubscribed cores wait at every op's barrier for a descheduled
# partner (a tiny-bd round that takes milliseconds took about 1 s so).
PYTEST_WORKERS ?= -n 2 --dist loadgroup
test: $(STAMP) lint deps
	bash scripts/ensure_chromium.sh || echo "chromium unavailable: the playground's browser test will be skipped"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q $(PYTEST_WORKERS)

# The unit tier for the edit loop (under 2 minutes on 2 cores): all but the Ray service tests (marker `ray`, set by
# tests/conftest.py on the tests of the shared Ray cluster) and the tests over ~3 s (`@pytest.mark.slow` at the test).
test-fast: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q $(PYTEST_WORKERS) -m "not ray and not slow"

# Fault injection, content-checked (1-4 minutes on 2 cores): 200 deterministic streamed requests (fixed
# thresholds; greedy or seeded sampling) first run without a fault (the reference), then again at 25 req/s while
# two of the three Denoiser replicas are killed (ray.kill). Prints `N lost, M mismatched` with the kills and
# failovers; fails on any lost request, any text that differs from its reference byte for byte, fewer than 2
# kills, fewer failovers than kills, or any clean failure (bound 0: nothing is shed while capacity is down).
test-faults: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/remask faults --scenario kill --requests 200 --kills 2 --rate 25 --max-failed 0

# The Ray Serve application on this machine (CPU, embedded tiny-bd model), on 127.0.0.1:8000.
serve: $(STAMP)
	RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=$${RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S:-60} \
		$(VENV)/bin/serve run serve_config.yaml

# The interactive generation demo (no Ray): watch the canvas unmask.
demo: $(STAMP)
	$(VENV)/bin/remask generate --model $${MODEL:-tiny-bd} --show-steps

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
