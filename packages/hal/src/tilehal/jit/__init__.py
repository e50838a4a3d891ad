"""Just-in-time compilers: C (system compiler + cffi) and CUDA (NVRTC or nvcc + driver API)."""
