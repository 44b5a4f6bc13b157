# The two commands of the README: `make serve` and `make test`.
# Each creates the virtualenv and installs what it needs on a fresh machine.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# CPU build of torch (a local wheel on these machines); an unpinned torch pulls a CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: test serve lint install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q

# Until the Ray Serve application lands, `make serve` runs the interactive
# generation demo on the embedded tiny-bd model.
serve: $(STAMP)
	$(VENV)/bin/remask generate --model $${MODEL:-tiny-bd} --show-steps

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
