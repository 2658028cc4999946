"""``kvring bench ...`` and ``kvring trace``: benchmarks that print a table, write JSON and a PNG
plot, and measure kvring against baselines in the same run (``demo``, ``dataplane``, ``e2e``, ``miss``,
``slow_node``, ``trace``; ``report`` writes their outputs, ``workload`` fills a cluster)."""
