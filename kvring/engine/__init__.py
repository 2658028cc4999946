"""Real vLLM engines for the demo, the benchmarks and the tests: ``run`` (offline ``LLM``
instances in child processes, driven by a JSON spec) and ``serve`` (``vllm serve``)."""
