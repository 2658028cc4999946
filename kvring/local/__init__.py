"""kvring on one machine: ``cluster`` starts etcd and node processes on loopback (``kvring up``,
the tests, the benchmarks)."""
