"""Fixtures of the sharding tests: one-rank sharded runs in the test process, with their process group torn down."""

from __future__ import annotations

import pytest
from sharding_harness import meta_build, weights

from polyattn_lightning.distributed import teardown_process_group


@pytest.fixture
def one_rank():
    """A test that runs the sharded strategy on one rank here: the process group it starts is destroyed after."""
    yield
    teardown_process_group(wait=False)


@pytest.fixture(scope="module")
def meta_built_decoder() -> dict:
    """The whole weights and the buffers of :func:`meta_build` on one rank."""
    try:
        model = meta_build(1)
        return {"weights": weights(model), "buffers": {n: b.clone() for n, b in model.named_buffers()}}
    finally:
        teardown_process_group(wait=False)
