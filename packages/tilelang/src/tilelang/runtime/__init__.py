"""Compile/JIT, kernels, profiler and autotuner."""
