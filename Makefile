# `make run` on a fresh machine: set up .venv, serve the default model and answer one request.
# `make test`: the test suite (what CI runs).
.PHONY: setup run test lint bench

setup: .venv/.setup-done

.venv/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

run: setup
	bash scripts/serve_and_ask.sh

test: setup
	.venv/bin/ruff check llmserve tests benchmarks
	.venv/bin/python -m pytest -q tests

lint: setup
	.venv/bin/ruff check llmserve tests benchmarks

bench: setup
	.venv/bin/python benchmarks/offline_throughput.py
