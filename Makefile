# Every target sets up .venv on first use. On a machine without CUDA the CPU wheel torch==2.13.0 is
# installed (it lies on the local disk); where the system Python already has a CUDA build of torch,
# the venv sees it (--system-site-packages) and it is kept.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

# One pip run, byte-compiled after on every core: pip compiles one file at a time (about 40 of
# its 70 s here). A few third-party files are for newer Pythons and do not compile: pip skips
# them without a word, and so does this.
$(STAMP): pyproject.toml
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "using the system's CUDA build of torch"; $(PY) -m venv --system-site-packages $(VENV); \
		$(BIN)/pip install -q --no-compile -e ".[dev,hf,log]"; \
	else \
		$(PY) -m venv $(VENV) && $(BIN)/pip install -q --no-compile torch==2.13.0 -e ".[dev,hf,log]"; \
	fi
	@$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null 2>&1 || true
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/zeroshard train --nproc 2 --config examples/demo.toml

# Two tests at a time (pytest-xdist; a module's tests stay on one worker, in order): most tests keep
# one core busy. Those marked `alone` (signals, bounds in seconds, 1 s timeouts) run after, by
# themselves. The package and the tests are byte-compiled first: hundreds of processes import
# them, and with PYTHONDONTWRITEBYTECODE set each compiled them again (0.2 s a process).
test: $(STAMP)
	@$(BIN)/python -m compileall -q -j 0 zeroshard tests > /dev/null
	$(BIN)/python -m pytest -q tests -n 2 --dist loadfile -m "not alone" --durations=10
	$(BIN)/python -m pytest -q tests -m alone --durations=5

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
