"""Benchmarks: offline throughput, latency, kernel speed, each against the roofline."""
