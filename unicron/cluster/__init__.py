"""Local clusters for the demo, tests and benchmarks: etcd servers, agents and coordinators as processes,
and the ranks-only local launcher (top layer, beside the CLI)."""
