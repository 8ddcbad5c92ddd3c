"""Benchmarks: I/O throughput, key hashing."""
