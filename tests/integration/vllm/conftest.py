"""Fixtures of the real-engine test modules: one in-process engine at a time per module, and the tiny
random-weight Llama (seed 0; a module needing other weights defines its own `model`)."""

from __future__ import annotations

import pytest
import vllm_util as U


@pytest.fixture(scope="module")
def engines():
    e = U.Engines()
    yield e
    e.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return U.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)
