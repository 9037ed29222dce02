"""residual_uniforms (the verifier engine's target-sample uniforms, a batch at once) equals generator(), bit for bit."""
import numpy as np

from edgespec.common.acceptance import target_sample_uniform
from edgespec.common.rng import residual_uniforms


def test_residual_uniforms_match_the_generator_bit_for_bit():
    rng = np.random.default_rng(0)
    trees = [(0, 0, 1), (-3, 5, 7), ((1 << 64) - 1, (1 << 63) + 5, 3), (1 << 70, 2, 2)]
    for _ in range(40):
        trees.append((int(rng.integers(0, 1 << 63)) * 2 + 1, int(rng.integers(0, 1 << 62)), int(rng.integers(1, 66))))
    got = residual_uniforms(trees)
    want = [target_sample_uniform(seed, step, node) for seed, step, n in trees for node in range(n)]
    assert got.dtype == np.float64 and got.tolist() == want
