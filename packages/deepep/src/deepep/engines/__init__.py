"""deepep's engines, one folder each, all built as `Engine(EngineOptions)` (deepep.dispatcher):

torch/ (any torch.distributed group), hierarchical.py (nodes of several ranks), nvlink/ (our kernels
on the GPUs of one host), local.py (one process, no torch.distributed). Buffer picks one.
"""
