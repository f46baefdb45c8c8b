"""`benchmarks/far_weighted_tune.py`: the sampled gradients of the read-weighted objective are those of the loss
`Σ_i w_i CE_i`, `w_i` the encoded keys position `i` reads over their mean."""

import importlib.util
from pathlib import Path

import torch

from torchkv.fitting.tuning.sensitivity import _exposed_gradients, _probed, exposed_pairs
from torchkv.pipeline import KVPipeline
from torchkv.testing import tiny_model

_spec = importlib.util.spec_from_file_location("far_weighted_tune", Path(__file__).parents[1] / "benchmarks" /
                                               "far_weighted_tune.py")
far_weighted_tune = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(far_weighted_tune)


def test_weighted_gradients_are_those_of_the_read_weighted_loss():
    model = tiny_model("llama", layers=2)
    pipe = KVPipeline.from_preset("frontier-2bit", residual=16).for_model(model)
    tokens = 96
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    exposed = exposed_pairs(pipe, tokens)
    weights = far_weighted_tune.read_weights(exposed)
    reads = exposed.sum(1).float()
    torch.testing.assert_close(weights, reads * tokens / reads.sum())
    assert weights[0] == 0 and weights[-1] > 1
    probes: dict = {}
    with _probed(model, probes), torch.enable_grad():
        got = far_weighted_tune.weighted_gradients()(model, ids, probes, torch.Generator().manual_seed(0), 1, exposed)
    reference: dict = {}
    with _probed(model, reference), torch.enable_grad():
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden)[0].float()  # [T, V]: one `LOGIT_CHUNK`, as sampled there
        labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=torch.Generator().manual_seed(0))
        (torch.nn.functional.cross_entropy(logits, labels[:, 0], reduction="none") * weights).sum().backward()
    for layer, probe in reference.items():
        want = _exposed_gradients(probe, probe.out.grad, exposed)
        (g_k, g_v), = got[layer]
        torch.testing.assert_close(g_k, want[0])
        torch.testing.assert_close(g_v, want[1])
        assert g_v.abs().max() > 0
    assert model.get_decoder()._forward_hooks == {}  # the hook is gone afterwards
