# `make run` on a fresh machine: set up .venv, serve the default model and answer one request.
# `make test`: the fast tier, every module's behaviour (at most 10 minutes on 2 cores).
# `make test-all`: everything, with real models, compiled graphs, processes and a clean install (what CI runs).
# `make test-clients`: client libraries' quick-starts from PyPI against the server and the gateway (CI runs it too).
.PHONY: setup run test test-all test-clients lint bench docs

setup: .venv/.setup-done

.venv/.setup-done: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

run: setup
	bash scripts/serve_and_ask.sh

lint: setup
	.venv/bin/ruff check llmserve tests benchmarks scripts

# the markers that put a test in the full tier, and why, are in pyproject.toml
test: lint
	.venv/bin/python -m pytest -q -m "not full" tests

test-all: lint
	.venv/bin/python -m pytest -q -m "not clients" tests

test-clients: setup
	.venv/bin/python -m pytest -q -m clients tests

# docs/configuration.md from the config's own fields and help texts
docs: setup
	.venv/bin/python scripts/config_docs.py

# llmserve served beside the peer servers installed under $$PEERS (absent ones are skipped)
bench: setup
	.venv/bin/python benchmarks/bench_vs_peers.py
