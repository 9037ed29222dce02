# The two commands of the README. Both do all set-up themselves (idempotent, cached).
PROMPT ?= Write a Python function that checks whether a string is a palindrome.
PYTEST_ARGS ?=

.PHONY: setup run test bench
setup:
	tools/setup.sh

run: setup
	.venv/bin/edgespec run "$(PROMPT)"

test: setup
	.venv/bin/ruff check edgespec tests tools
	.venv/bin/python -m pytest $(PYTEST_ARGS)

bench: setup
	.venv/bin/python tools/bench_local.py
