import math

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
