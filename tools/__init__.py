"""What users run against a served app: the load tester (``pdserve-loadtest``: workloads,
clients, statistics, goodput, plots, Mooncake trace replay and the trace generator, the prefix-cache
hit rate read from /metrics), the chaos soak with its fault injector, and the kill
matrix. Measurements of pdserve itself are benchmarks/'s."""
