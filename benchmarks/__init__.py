"""Benchmarks of elastic against plain torch DDP and Ray Train; see benchmarks/bench.py."""
