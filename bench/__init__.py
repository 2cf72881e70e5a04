"""Benchmarks for meshserve: engine micro-benchmarks and the `bench.serve` HTTP load generator."""
