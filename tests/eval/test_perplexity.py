import math

import pytest
import torch

from wushkv.eval.perplexity import perplexity

from conftest import tiny_model


def test_perplexity_equals_hand_computation(family):
    model = tiny_model(family)
    g = torch.Generator().manual_seed(0)
    chunks = torch.randint(3, 96, (3, 24), generator=g)
    res = perplexity(model, chunks, show_progress=False)
    # hand computation: log-softmax and gather, token by token
    total, n = 0.0, 0
    with torch.no_grad():
        for c in chunks:
            logits = model(c[None]).logits[0].double()
            logp = logits.log_softmax(-1)
            for t in range(c.numel() - 1):
                total -= float(logp[t, c[t + 1]])
                n += 1
    assert res["tokens"] == n == 3 * 23
    assert math.isclose(res["nll"], total / n, rel_tol=1e-5)
    assert math.isclose(res["ppl"], math.exp(total / n), rel_tol=1e-5)
    assert res["chunks"] == 3


def _exact_kl(p_logits, q_logits):
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def test_coarse_kl_is_exact_over_the_vocabulary_and_a_lower_bound_that_grows_with_k():
    """Over all V tokens the coarse KL is the KL; over the top k and one outcome for the rest it never exceeds it
    (merging outcomes cannot raise a KL) and grows with k (a finer partition); 0 against itself."""
    from wushkv.eval.perplexity import Reference, coarse_kl

    g = torch.Generator().manual_seed(0)
    p = torch.randn(300, 97, generator=g) * 3  # more positions than one block of rows
    q = p + 0.3 * torch.randn(300, 97, generator=g)
    exact = _exact_kl(p, q)
    assert torch.allclose(coarse_kl(Reference.of(p, 97), q), exact, atol=1e-6)
    assert torch.allclose(coarse_kl(Reference.of(p, 500), q), exact, atol=1e-6)  # k past V: the whole vocabulary
    assert coarse_kl(Reference.of(p, 20), p).abs().max() < 1e-6
    prev = torch.zeros(300, dtype=torch.float64)
    for k in (1, 5, 20, 60, 97):
        got = coarse_kl(Reference.of(p, k), q)
        assert (got <= exact + 1e-6).all() and (got >= prev - 1e-6).all() and (got >= 0).all()
        prev = got
    assert float(coarse_kl(Reference.of(p, 5), q).mean()) < 0.9 * float(exact.mean())  # a lower bound, not the KL
    # the rest is taken as a log-sum-exp, not 1 - sum(top): a top holding all but 1e-9 of the mass keeps its rest
    peaked = torch.zeros(1, 50)
    peaked[0, 0] = 25.0
    r = Reference.of(peaked, 1)
    assert torch.isfinite(r.log_rest).all() and math.isclose(float(r.log_rest[0]), math.log(49) - 25, rel_tol=1e-4, abs_tol=1e-4)
    with pytest.raises(ValueError, match="k >= 1"):
        Reference.of(p, 0)
    with pytest.raises(ValueError, match="logits for 299 positions against a reference of 300"):
        coarse_kl(Reference.of(p, 5), q[:299])


def test_perplexity_measures_the_kl_to_a_full_precision_reference(family):
    """A run given full precision's references reports per chunk the mean KL over its predicted positions, equal to the
    hand-computed KL when the references keep the whole vocabulary; full precision against itself: 0."""
    model, other = tiny_model(family), tiny_model(family, seed=1)
    g = torch.Generator().manual_seed(0)
    chunks = torch.randint(3, 96, (3, 24), generator=g)
    V = model.config.vocab_size
    fp = perplexity(model, chunks, show_progress=False, keep_reference=V)
    assert len(fp["reference"]) == 3 and "kl" not in fp
    again = perplexity(model, chunks, show_progress=False, reference=fp["reference"])
    assert max(again["chunk_kl"]) < 1e-6 and again["nll"] == fp["nll"]
    got = perplexity(other, chunks, show_progress=False, reference=fp["reference"])
    with torch.no_grad():
        want = [float(_exact_kl(model(c[None]).logits[0, :-1], other(c[None]).logits[0, :-1]).mean()) for c in chunks]
    assert got["chunk_kl"] == pytest.approx(want, rel=1e-4)
    assert got["kl"] == pytest.approx(sum(want) / 3, rel=1e-4)
    with pytest.raises(ValueError, match="a reference of 3 chunks for 2 chunks"):
        perplexity(other, chunks[:2], show_progress=False, reference=fp["reference"])
