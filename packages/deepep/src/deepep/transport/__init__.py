"""Transports: how rows move between ranks (torch.distributed, hierarchical, NVLink kernels)."""
