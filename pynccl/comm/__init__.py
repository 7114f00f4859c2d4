"""The communication core: process groups and rendezvous, the torch.distributed-like functions
(distributed.py), the backends that run them (backends/: nccl over pynccl._C, gloo over torch),
the cross-rank collective check and the flight recorder. Every other layer talks to it through
pynccl.comm.distributed."""
