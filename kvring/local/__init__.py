"""kvring on one machine: ``cluster`` starts etcd and node processes on loopback (``kvring up``,
the tests, the benchmarks); ``rundir`` gives a run one temporary directory, removed however the
run ends, and ``signals`` makes SIGHUP and SIGTERM unwind a run as Ctrl-C does."""
