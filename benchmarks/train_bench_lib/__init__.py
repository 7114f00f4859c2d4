"""The pieces of benchmarks/train_bench.py, one responsibility each:

  models.py          HF model configs from flags, random init, the fixed token batches, layouts
  harness.py         time one runner (warm-up, CUDA-event steps, peak memory, losses over ranks)
  pynccl_runners.py  the pynccl side of every strategy
  torch_runners.py   the torch side (DDP, FSDP2, DTensor TP, torch.distributed.pipelining, FSDP2 + TP),
                     and the plain one-GPU model
  floor.py           --floor: each pair's no-communication floor, rank 0 alone at world size 1
  torch_tp_plan.py   the torchtitan-style DTensor plan for an HF Llama
  report.py          the table, the ratios and floor costs, the JSON rows, the plot
"""
