"""The blocks a restore of a prefix writes, which a failed restore reports invalid, written out by hand for
a registration of three groups of different tokens per block, with holes (-1) and blocks beyond the prefix.
Both the code (bsr_runtime.retrieve.request_block_ids) and the tests' oracle (bsr_harness.testdata.
prefix_block_ids, used by the fault matrix, the fail-closed property test, start_load and the TP workers)
must give exactly these sets: a slice that drops a group's last block is caught by every test using either."""

from __future__ import annotations

import pytest
import torch

from bsr_harness.testdata import prefix_block_ids
from bsr_kernels import Registration, TensorSpec
from bsr_runtime.retrieve import request_block_ids

REG = Registration((
    TensorSpec("full", torch.uint8, (8,), block_size=64),  # group 0: 64 tokens per block
    TensorSpec("c4", torch.uint8, (8,), block_size=64, token_ratio=4, group=1),  # 256 tokens per block
    TensorSpec("c128", torch.uint8, (8,), block_size=16, token_ratio=128, group=2, sliding_window=512),  # 2048
), chunk_tokens=256)
TABLES = [[10, -1, 12, 13, 14, 15, 16, 17, 18, 19], [5, 6, 7], [-1, 3]]
EXPECTED = {
    1: (frozenset({10, 12, 13}), frozenset({5}), frozenset()),
    2: (frozenset({10, 12, 13, 14, 15, 16, 17}), frozenset({5, 6}), frozenset()),
    0: (frozenset(), frozenset(), frozenset()),
}


@pytest.mark.parametrize("n", sorted(EXPECTED))
@pytest.mark.parametrize("as_tensors", [False, True])
def test_blocks_of_a_prefix_written_out(n, as_tensors):
    tables = [torch.tensor(t) for t in TABLES] if as_tensors else TABLES
    assert prefix_block_ids(REG, tables, n) == EXPECTED[n]
    assert request_block_ids(REG, tables, n) == EXPECTED[n]
