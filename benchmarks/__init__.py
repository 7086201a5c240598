"""Benchmarks: speed reported as ratios against a peer measured in the same run."""
