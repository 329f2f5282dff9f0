"""What users run against a served app: the load tester (``pdserve-loadtest``: workloads,
clients, statistics, goodput, plots), the chaos soak with its fault injector, and the kill
matrix. Measurements of pdserve itself are benchmarks/'s."""
