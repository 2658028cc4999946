# kvring: `make demo` runs a local cluster with a short workload; `make test` runs the tests.
# Both set up what they need first (scripts/setup.sh: etcd, redis, .venv).

.PHONY: setup demo up test bench trace clean

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/kvring up --nodes 3 --memory 1GiB --demo

up: setup
	.venv/bin/kvring up --nodes 3 --memory 1GiB

test: setup
	.venv/bin/python -P -m pytest -q -p no:cacheprovider tests

bench: setup
	.venv/bin/kvring bench data-plane --json out/bench-data-plane.json --plot out/bench-data-plane.png

trace: setup
	.venv/bin/kvring trace ../shared/traces/conversation_trace.jsonl --json out/trace.json --plot out/trace.png

clean:
	rm -rf .venv out build *.egg-info
