"""Shared pytest configuration: GPU tests are skipped where no CUDA device exists."""
import os

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
