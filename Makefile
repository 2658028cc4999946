# kvring: `make demo` runs two vLLM instances sharing prefixes through a local cluster; `make test` runs the tests.
# Both set up what they need first (scripts/setup.sh: etcd, redis, .venv).

.PHONY: setup demo up test bench bench-e2e bench-miss bench-slow-node bench-repair bench-membership bench-tls trace clean

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/kvring demo --plot out/demo.png

up: setup
	.venv/bin/kvring up --nodes 3 --memory 1GiB

test: setup
	.venv/bin/python -P -m pytest -q -p no:cacheprovider tests

bench: setup
	.venv/bin/kvring bench data-plane --json out/bench-data-plane.json --plot out/bench-data-plane.png

bench-e2e: setup
	.venv/bin/kvring bench e2e --json out/bench-e2e.json --plot out/bench-e2e.png

bench-miss: setup
	.venv/bin/kvring bench miss --json out/bench-miss.json --plot out/bench-miss.png

bench-slow-node: setup
	.venv/bin/kvring bench slow-node --json out/bench-slow-node.json --plot out/bench-slow-node.png

bench-repair: setup
	.venv/bin/kvring bench repair --json out/bench-repair.json --plot out/bench-repair.png

bench-membership: setup
	.venv/bin/kvring bench membership --json out/bench-membership.json --plot out/bench-membership.png

bench-tls: setup
	.venv/bin/kvring bench tls --json out/bench-tls.json --plot out/bench-tls.png

trace: setup
	.venv/bin/kvring trace ../shared/traces/conversation_trace.jsonl --json out/trace.json --plot out/trace.png

clean:
	rm -rf .venv out build *.egg-info
