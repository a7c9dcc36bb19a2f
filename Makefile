# Two commands on a fresh machine with only python3:
#   make demo   creates .venv, installs moesim (llama-cpp-python compiles once, ~5 min on 2 cores), runs the demo
#   make test   same environment, runs the whole test suite (pytest-xdist: one worker per core)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.moesim-installed

.PHONY: demo test lint bench install clean

install: $(STAMP)

# pip -qq prints errors only: a machine's own pip configuration (an extra index folder that
# lacks some packages, say) otherwise prints a warning per package during make demo / make test
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --upgrade pip
	$(BIN)/python -m pip install -qq -e '.[test,ray,mlx]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/moesim demo

test: $(STAMP)
	$(BIN)/python -m ruff check moesim tests bench
	$(BIN)/python -m pytest -q -n auto --dist worksteal

bench: $(STAMP)
	for script in bench/bench_*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) moesim-demo .pytest_cache
