# The two commands of the README: `make serve` and `make test`.
# Each creates the virtualenv and installs what it needs on a fresh machine.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# CPU build of torch (a local wheel on these machines); an unpinned torch pulls a CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: test test-faults serve demo lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# the playground's browser test drives Debian's headless Chromium (installed here when missing)
test: $(STAMP) lint
	bash scripts/ensure_chromium.sh || echo "chromium unavailable: the playground's browser test will be skipped"
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q

# Fault injection (a few minutes): 200 streamed requests, two Denoiser replicas killed under load;
# fails unless every request completed or failed cleanly.
test-faults: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/remask faults --requests 200 --kills 2 --rate 25

# The Ray Serve application on this machine (CPU, embedded tiny-bd model), on 127.0.0.1:8000.
serve: $(STAMP)
	RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=$${RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S:-60} \
		$(VENV)/bin/serve run serve_config.yaml

# The interactive generation demo (no Ray): watch the canvas unmask.
demo: $(STAMP)
	$(VENV)/bin/remask generate --model $${MODEL:-tiny-bd} --show-steps

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
