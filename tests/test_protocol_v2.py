"""PoC v2 protocol pieces against golden/v2_golden.json (no model needed)."""

import base64
import struct

import numpy as np
import pytest
import torch

from poc.protocol import v2

from .golden import V2_GOLDEN as G

RV = G["rng_vectors"]
BH = G["parameters"]["block_hash"]
PK = G["parameters"]["public_key"]


def _f32(hexes):
    return np.array([struct.unpack(">f", bytes.fromhex(h))[0] for h in hexes], dtype=np.float32)


def test_seeds():
    for s, v in RV["seed_from_string"].items():
        assert v2.seed32(s) == v
    assert v2.seeds256("x")[0] == v2.seed32("x")


def test_murmur_variant():
    for key, v in RV["murmur3_variant"].items():
        a = dict(kv.split("=") for kv in key.split(","))
        got = v2.murmur(torch.tensor([int(a["key"])]), torch.tensor([int(a["seed"])])).item()
        assert got == v, key


def test_murmur_is_not_textbook():
    # textbook MurmurHash3 of 4 little-endian bytes has the `h ^= 4` step; ours must not
    def textbook(key, seed):
        m = 0xFFFFFFFF
        k = (key * 0xCC9E2D51) & m
        k = ((k << 15) | (k >> 17)) & m
        k = (k * 0x1B873593) & m
        h = seed ^ k
        h = ((h << 13) | (h >> 19)) & m
        h = (h * 5 + 0xE6546B64) & m
        h ^= 4
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & m
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & m
        return h ^ (h >> 16)

    keys = torch.arange(1000)
    ours = v2.murmur(keys, torch.tensor(0)).tolist()
    assert sum(a == textbook(k, 0) for k, a in enumerate(ours)) == 0


def test_uniform_range_and_resolution():
    u = v2.uniforms([1, 2, 3], 10_000)
    assert u.dtype == torch.float32 and float(u.min()) >= 0 and float(u.max()) <= 1


@pytest.mark.parametrize("stronger", [False, True])
def test_inputs_golden(stronger):
    x = v2.inputs(BH, PK, [0], 256, 4096, stronger_rng=stronger).flatten()
    if stronger:
        first, other, at = (RV["inputs_stronger_S256_H4096_nonce0_first8_f32hex"],
                            RV["inputs_stronger_S256_H4096_nonce0_segment1_first4_f32hex"], (256 * 4096 + 7) // 8)
    else:
        first, other, at = (RV["inputs_legacy_S256_H4096_nonce0_first8_f32hex"],
                            RV["inputs_legacy_S256_H4096_nonce0_at_flat_index_524288_f32hex"], 524288)
    # libm differences: 1-2 ulp (spec-v2 §g), far under any tolerance that matters
    np.testing.assert_allclose(x[:8].numpy(), _f32(first), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(x[at:at + 4].numpy(), _f32(other), rtol=1e-6, atol=1e-7)


def test_box_muller_half_split_and_odd_length():
    n = 7
    out = v2.normals([123], n)[0]
    u = v2.uniforms([123], 8)[0]
    r = torch.sqrt(-2 * torch.log(u[:4].clamp_min(1e-10)))
    th = 6.2831855 * u[4:]
    ref = torch.cat([r * torch.cos(th), r * torch.sin(th)])[:7]
    torch.testing.assert_close(out, ref)


def test_inputs_batch_equals_single():
    a = v2.inputs(BH, PK, [5, 9, 11], 4, 33, stronger_rng=True)
    for i, n in enumerate([5, 9, 11]):
        torch.testing.assert_close(a[i], v2.inputs(BH, PK, [n], 4, 33, stronger_rng=True)[0], rtol=0, atol=0)


def test_layer_vectors():
    v = v2.layer_vectors(BH, 3, 4096)
    np.testing.assert_allclose(v[0, :4].numpy(), RV["layer_vector_H4096_layer0_first4"], rtol=1e-6, atol=3e-8)
    torch.testing.assert_close(v.norm(dim=1), torch.ones(3))


def test_pick_cuda_order():
    for key, want in RV["pick_indices_cuda_order"].items():
        a = dict(kv.split("=") for kv in key.split(","))
        got = v2.pick_indices(BH, PK, [int(a["nonce"])], int(a["H"]), 12)[0].tolist()
        assert got == want, key
    for name, m in G["models"].items():
        got = v2.pick_indices(BH, PK, [0], m["config"]["hidden_size"], 12)[0].tolist()
        assert got == m["debug_nonce0"]["pick_indices_cuda_order"], name


def test_pick_bounds():
    for k in (0, 65):
        with pytest.raises(ValueError):
            v2.pick_indices(BH, PK, [0], 64, k)
    assert v2.pick_indices(BH, PK, [0], 64, 64).sort(dim=1).values.tolist() == [list(range(64))]


def test_project_matches_golden_debug():
    """xk -> Haar -> normalise, from the golden debug vectors of nonce 0."""
    for name, m in G["models"].items():
        d = m["debug_nonce0"]
        xk = torch.tensor(d["xk_f32"], dtype=torch.float32)
        hv = v2.haar_vectors(BH, PK, [0], 12)
        y = xk.clone()[None]
        for j in range(11):
            v = hv[:, j]
            y = y - 2 * (y * v).sum(1, keepdim=True) * v
        # the golden debug vector is stored unit-norm; orthogonal steps commute with normalising
        want = np.array(d["yk_before_final_norm_f32"])
        np.testing.assert_allclose((y[0] / y[0].norm()).numpy(), want / np.linalg.norm(want), rtol=0, atol=2e-6)
        torch.testing.assert_close(y.norm(), xk.norm())  # k-1 reflections preserve the norm


def test_encode_decode_roundtrip():
    vec = np.array([0.1, -0.5, 0.333, 1.0], dtype=np.float32)
    b64 = v2.encode(vec)
    assert base64.b64decode(b64) == vec.astype("<f2").tobytes()
    np.testing.assert_array_equal(v2.decode(b64), vec.astype(np.float16).astype(np.float32))
    for bad in ["!!!", "AAA"]:
        with pytest.raises(ValueError):
            v2.decode(bad)
    art = G["models"]["qwen3"]["artifacts"][0]
    np.testing.assert_array_equal(v2.decode(art["vector_b64"]), np.array(art["vector_f32_from_f16"], np.float32))


def test_artifacts_drop_non_finite():
    vecs = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [float("inf"), 1.0]])
    arts, bad = v2.artifacts([7, 8, 9], vecs)
    assert [a["nonce"] for a in arts] == [7] and bad == [8, 9]


def binomial_tail(k: int, n: int, p: float) -> float:
    """P[Bin(n, p) >= k], summed directly."""
    import math
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def test_validation_rules():
    arts = {a["nonce"]: a["vector_b64"] for a in G["models"]["qwen3"]["artifacts"]}
    nonces = sorted(arts)
    st = v2.StatTest()
    r = v2.validate(arts, dict(arts), nonces, 12, st)
    assert (r["n_total"], r["n_mismatch"], r["fraud_detected"]) == (8, 0, False)
    # corrupt one vector, blank one, send garbage and a NaN vector: all mismatches (the reference skips blanks)
    bad = dict(arts)
    bad[0] = v2.encode(-v2.decode(arts[0]))
    bad[1] = ""
    bad[2] = "not base64!"
    bad[3] = v2.encode(np.full(12, np.nan, np.float32))
    bad[4] = v2.encode(v2.decode(arts[4])[:11])
    del bad[5]
    r = v2.validate(arts, bad, nonces, 12, st)
    assert r["n_mismatch"] == 6 and sorted(r["mismatch_nonces"]) == [0, 1, 2, 3, 4, 5] and r["fraud_detected"]
    assert [x["nonce"] for x in r["per_nonce"] if x["mismatch"]] == [0, 1, 2, 3, 4, 5]
    assert [x["dist"] is None for x in r["per_nonce"]] == [False, True, True, True, True, True, False, False]
    # a nonce the validator could not compute is neither honest nor a mismatch: it leaves the sample (plugin 0.1.3)
    mine = dict(arts)
    del mine[7]
    r = v2.validate(mine, bad, nonces, 12, st)
    assert (r["n_total"], r["n_excluded"], r["excluded_nonces"], r["n_mismatch"]) == (7, 1, [7], 6)
    assert [x["nonce"] for x in r["per_nonce"]] == list(range(7))
    assert r["p_value"] == pytest.approx(binomial_tail(6, 7, st.p_mismatch))  # over the 7 scored nonces
    # more than 10% of the request unscored (at least one is tolerated): the validator gives no verdict
    del mine[6]
    with pytest.raises(v2.NoVerdict, match="2 of 8"):
        v2.validate(mine, arts, nonces, 12, st)
    many = {n: arts[n % 8] for n in range(30)}
    assert v2.validate({n: v for n, v in many.items() if n not in (1, 2, 3)}, many, list(range(30)), 12,
                       st)["n_excluded"] == 3  # int(30 * 0.1) = 3
    with pytest.raises(v2.NoVerdict):
        v2.validate({n: v for n, v in many.items() if n not in (1, 2, 3, 4)}, many, list(range(30)), 12, st)
    with pytest.raises(v2.NoVerdict, match="none of the 1"):  # one nonce, none scored: no verdict over nothing
        v2.validate({}, {0: arts[0]}, [0], 12, st)
    # thresholds from spec-v2 §d: 100 nonces, 2 mismatches -> p = 0.0046 (fraud at 0.01)
    from poc.protocol.stats import fraud_test
    p, fraud = fraud_test(2, 100, 0.001, 0.01)
    assert abs(p - 0.0046) < 1e-4 and fraud
    assert not fraud_test(1, 100, 0.001, 0.01)[1]
