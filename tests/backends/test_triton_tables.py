"""The Triton launchers' tables (``kernels/_common.py``), host side only.

``launch_groups`` reads each tensor's ``data_ptr()`` and element count once and keeps them with
its groups; ``launch_table`` reuses them only for the ``streams`` they were read from (the same
list object) and reads the tensors otherwise. The table's values are those of the layout in
``_common``'s docstring: pointer columns, numels, chunk -> tensor, chunk -> first element.
"""

import pytest
import torch

pytest.importorskip("triton")

from fastamp.kernels import _common as C  # noqa: E402


def _expected(ptr_columns, numels, chunk, rows=None):
    """The table's values, written the plain way (one Python loop)."""
    tensor_of, start_of = [], []
    for t, n in enumerate(numels):
        for s in range(0, n, chunk):
            tensor_of.append(t)
            start_of.append(s)
    values = [p for col in ptr_columns for p in col] + list(numels) + tensor_of + start_of
    return values + (list(rows) if rows is not None else []), len(tensor_of)


@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("numels", [[], [1], [4, 4, 4], [1, 3, 2], [5], [4, 9, 1, 64, 65, 3], [128, 1, 1], [64] * 7])
@pytest.mark.parametrize("with_rows", [False, True])
def test_table_values_match_the_layout(numels, chunk, with_rows):
    cols = [[1000 * (k + 1) + i for i in range(len(numels))] for k in range(3)]
    rows = [4 * i for i in range(len(numels))] if with_rows else None
    values, n_chunks = C._table_values(cols, numels, chunk, rows)
    want, want_chunks = _expected(cols, numels, chunk, rows)
    assert n_chunks == want_chunks
    assert list(values) == want
    table = C._host_table(values)
    assert table.dtype == torch.int64 and table.tolist() == want
    # the table owns its memory: changing the values afterwards changes nothing
    if len(values):
        values[0] = -1
        assert table.tolist() == want


def _streams(n, offset=0):
    base = [torch.zeros(8 * n + 8) for _ in range(3)]
    return [[b[offset + 8 * i : offset + 8 * i + 5] for i in range(n)] for b in base]


def test_launch_table_reuses_reads_only_for_its_own_streams():
    streams = _streams(4)
    groups = C.launch_groups(streams, lambda i: (streams[0][i].dtype,))
    ((key, idxs),) = groups.items()
    assert key == (torch.float32, True) and list(idxs) == [0, 1, 2, 3]
    table, n_chunks, n_ptr, apart = C.launch_table(idxs, streams, None, 4, torch.device("cpu"), 0)
    assert n_ptr == 3 and n_chunks == 8 and apart is None
    want, _ = _expected([[t.data_ptr() for t in s] for s in streams], [5] * 4, 4, [0] * 4)
    assert table.tolist() == want
    # the same indices with other tensors: read from those, not from the kept reads
    other = _streams(4, offset=1)
    table2, _, _, _ = C.launch_table(idxs, other, 7, 4, torch.device("cpu"), 4)
    want2, _ = _expected([[t.data_ptr() for t in s] for s in other] + [[7, 8, 9, 10]], [5] * 4, 4, [0, 4, 8, 12])
    assert table2.tolist() == want2
    # a stream's column apart (the optimizer's grads): returned as a list, the table without it
    table3, n_chunks3, n_ptr3, apart = C.launch_table(idxs, other, 7, 4, torch.device("cpu"), 4, apart=1)
    cols = [[t.data_ptr() for t in s] for s in other]
    assert apart == cols.pop(1) and n_ptr3 == 3 and n_chunks3 == 8
    want3, _ = _expected([*cols, [7, 8, 9, 10]], [5] * 4, 4, [0, 4, 8, 12])
    assert table3.tolist() == want3


def test_launch_groups_split_by_key_and_alignment_and_skip_empty():
    streams = _streams(5)
    streams[1][2] = torch.zeros(6)[1:]  # same numel, one element in: not 16-byte aligned
    streams[0][4] = torch.zeros(0)
    for s in streams[1:]:
        s[4] = torch.zeros(0)
    dtypes = [torch.float32, torch.float16, torch.float32, torch.float16, torch.float32]
    groups = C.launch_groups(streams, lambda i: (dtypes[i],))
    assert {k: list(v) for k, v in groups.items()} == {
        (torch.float32, True): [0],
        (torch.float16, True): [1, 3],
        (torch.float32, False): [2],
    }
    for idxs in groups.values():
        table, n_chunks, _, _ = C.launch_table(idxs, streams, None, 4, torch.device("cpu"), 3)
        cols = [[s[i].data_ptr() for i in idxs] for s in streams]
        want, want_chunks = _expected(cols, [5] * len(idxs), 4, [3 * i for i in idxs])
        assert n_chunks == want_chunks and table.tolist() == want
