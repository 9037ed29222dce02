"""Shared fixtures: real models from the cache (fetched by tools/setup.sh), loaded once per run."""
from __future__ import annotations

import os

import pytest

# Triton kernels run in its CPU interpreter in the tests (CI has no GPU). The mode is read when a
# kernel is defined, so it must be set before any test module imports triton, not in one of them.
os.environ.setdefault("TRITON_INTERPRET", "1")

from edgespec.common import modelstore


@pytest.fixture(scope="session")
def smol_path():
    return modelstore.resolve("test", progress=False)


@pytest.fixture(scope="session")
def smol_model(smol_path):
    from edgespec.runtime.llama import LlamaModel
    return LlamaModel(smol_path)


@pytest.fixture(scope="session")
def qwen_paths():
    return modelstore.resolve("draft", progress=False), modelstore.resolve("target", progress=False)


@pytest.fixture(scope="session")
def qwen_models(qwen_paths):
    from edgespec.runtime.llama import LlamaModel
    return LlamaModel(qwen_paths[0]), LlamaModel(qwen_paths[1])


@pytest.fixture(scope="module")
def torch_one_thread():
    """torch at one intra-op thread for a module's tests (two stall on this 2-core machine kind)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
