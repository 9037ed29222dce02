"""Shared fixtures: real models from the cache (fetched by tools/setup.sh), loaded once per run."""
from __future__ import annotations

import pytest

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
