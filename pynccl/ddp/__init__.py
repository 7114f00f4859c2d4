"""Data parallelism: the DistributedDataParallel module (module.py), its reducer (reducer.py),
gradient buckets (buckets.py), comm hooks (hooks.py) and SyncBatchNorm (sync_batchnorm.py)."""
from .module import DistributedDataParallel
from .sync_batchnorm import SyncBatchNorm

__all__ = ["DistributedDataParallel", "SyncBatchNorm"]
