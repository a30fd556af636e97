# The two commands of the README: `make demo` (main job) and `make test` (whole test suite).
.PHONY: setup demo test bench
setup:
	@bash scripts/setup.sh
demo: setup
	.venv/bin/spinwheel demo
test: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not serial"
	.venv/bin/python -m pytest -q -m serial
