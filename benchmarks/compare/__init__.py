"""Side-by-side comparison of unbroken with plain DDP, torchrun elastic, torchft and Ray Train.

Run with ``python benchmarks/bench_compare.py``; see that file for the options.
"""
