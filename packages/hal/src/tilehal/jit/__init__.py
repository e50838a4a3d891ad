"""Just-in-time compilers: C (c.py: system compiler + cffi) and CUDA (cuda.py: NVRTC or nvcc;
launch.py: driver API loading and launching)."""
