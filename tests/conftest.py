"""Shared fixtures: every test starts with fp32 default dtype, a fixed seed and no process group."""

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _clean_torch_state():
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
    if dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
