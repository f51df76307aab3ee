"""Which rank is which: the layout of replicas x pp x tp, the stage layer ranges, the nonce streams (no processes)."""

import pytest

from poc.errors import InputError
from poc.model.config import ModelConfig
from poc.parallel.layout import Layout, stage_layers
from poc.protocol import v1
from poc.protocol.nonces import Lattice

from .golden import v2_checkpoint


# --- layout, stages, nonce streams --------------------------------------------------------------------------------

def test_layout_ranks_and_groups():
    L = Layout(8, tp=2, pp=2)
    assert L.replicas == 2 and L.group_size == 4
    assert [L.coords(r) for r in range(8)] == [(r // 4, (r // 2) % 2, r % 2) for r in range(8)]
    assert all(L.rank(*L.coords(r)) == r for r in range(8))
    assert (L.leader(1), L.reporter(1)) == (4, 6)
    assert L.replica_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert L.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert L.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_uneven_splits_are_refused_naming_the_numbers():
    with pytest.raises(InputError, match=r"6 devices .* tp=4 x pp=1 = 4"):
        Layout(6, tp=4)
    with pytest.raises(InputError) as e:
        Layout(6, tp=3, pp=2).check_model(n_heads=4, n_kv_heads=2, ffn_dim=128, n_layers=1)
    msg = e.value.message
    for part in ("n_heads=4", "n_kv_heads=2", "ffn_dim=128", "tp=3", "n_layers=1", "pp=2"):
        assert part in msg, (part, msg)
    Layout(4, tp=2, pp=2).check_config(ModelConfig.from_hf(v2_checkpoint("qwen3")))  # 4 heads, 2 kv, 2 layers


def test_stage_layers_are_balanced_and_cover():
    assert stage_layers(28, 3) == [range(0, 9), range(9, 18), range(18, 28)]  # the extra layer on the last stage
    assert [len(r) for r in stage_layers(62, 4)] == [15, 15, 16, 16]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]
    for n, s in [(1, 1), (7, 7), (36, 4), (61, 8)]:
        st = stage_layers(n, s)
        assert [i for r in st for i in r] == list(range(n))
        assert max(map(len, st)) - min(map(len, st)) <= 1
    with pytest.raises(InputError, match="n_layers=2 .* 3"):
        stage_layers(2, 3)


def test_nonce_streams_split_disjoint_and_complete():
    s = Lattice(5, 3)
    parts = s.split(4)
    head = [n for _, n in zip(range(400), s)]
    got = sorted(n for p in parts for _, n in zip(range(100), p))
    assert got == head
    # pow's lattice: part r is group group_id + r*n_groups of n_groups*R
    node_id, node_count, group_id, n_groups, R = 2, 5, 1, 3, 2
    pow_stream = Lattice(node_id + group_id * node_count, n_groups * node_count)
    for r, p in enumerate(pow_stream.split(R)):
        want = v1.node_nonces(node_id, node_count, group_id + r * n_groups, n_groups * R)
        assert [n for _, n in zip(range(20), p)] == [n for _, n in zip(range(20), want)]
    # a finite /pooled range
    rng = Lattice(10, 2, end=40)
    assert list(rng) == list(v1.range_nonces(10, 40, 0, 2))
    assert sorted(n for p in rng.split(3) for n in p) == list(rng)
