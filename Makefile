# `make run` on a fresh machine: set up .venv, then serve... (see README). `make test`: the test suite.
.PHONY: setup run test lint bench

setup: .venv/.setup-done

.venv/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

run: setup
	.venv/bin/llmserve generate --chat "What is the capital of France? Answer in one sentence."

test: setup
	.venv/bin/ruff check llmserve tests benchmarks
	.venv/bin/python -m pytest -q tests

lint: setup
	.venv/bin/ruff check llmserve tests benchmarks

bench: setup
	.venv/bin/python benchmarks/offline_throughput.py
