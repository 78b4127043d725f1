"""Built-in models: sizes, determinism, tying, and the shape-only (meta) description."""

import pytest
import torch

from gradtap.core.errors import ConfigError, PlanError
from gradtap.workload import models
from gradtap.workload.data import Batch

TINY_GPT = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 97, "block_size": 16}


def test_sizes():
    params, _ = models.describe("gradtap.workload.models:mlp")
    assert sum(p.numel for p in params) == 1_055_242
    assert [p.name for p in params][:2] == ["layers.0.weight", "layers.0.bias"]
    params, _ = models.describe("gradtap.workload.models:gpt2")
    assert sum(p.numel for p in params) == 124_439_808  # GPT-2 small
    assert len(params) == 148 and params[0].name == "transformer.wte.weight"
    params, _ = models.describe("gradtap.workload.models:flowcheck_testbed")
    assert sum(p.numel for p in params) == 44_712_448
    assert all(p.dtype == "float32" for p in params)


def test_tied_head_is_listed_once_and_ready_last():
    model = models.build("gradtap.workload.models:gpt2", TINY_GPT, seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [p.name for p in models.param_specs(model)]
    assert "lm_head.weight" not in names and names.count("transformer.wte.weight") == 1
    _, order = models.describe("gradtap.workload.models:gpt2", TINY_GPT)
    assert names[order[-1]] == "transformer.wte.weight"
    # LayerNorm hands over its weight gradient before its bias gradient.
    assert order.index(names.index("transformer.ln_f.weight")) < order.index(names.index("transformer.ln_f.bias"))


@pytest.mark.parametrize("factory,kwargs", [("gradtap.workload.models:mlp", {"sizes": [8, 16, 4]}),
                                            ("gradtap.workload.models:gpt2", TINY_GPT),
                                            ("gradtap.workload.models:flowcheck_testbed", {"n_layer": 1, "vocab_size": 300})])
def test_meta_description_equals_a_real_model(factory, kwargs):
    params, order = models.describe(factory, kwargs, seq_len=None if "mlp" in factory else 8)
    model = models.build(factory, kwargs, seed=1)
    assert models.param_specs(model) == params
    data = model.synthetic_data(batch_size=3, seed=2, seq_len=None if "mlp" in factory else 8)
    assert models.grad_ready_order(model, data.batch(1, 4)) == order
    assert all(p.grad is None for p in model.parameters())


def test_build_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = models.build("gradtap.workload.models:gpt2", TINY_GPT, seed=7)
    b = models.build("gradtap.workload.models:gpt2", TINY_GPT, seed=7)
    c = models.build("gradtap.workload.models:gpt2", TINY_GPT, seed=8)
    assert torch.equal(torch.get_rng_state(), before)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)
    # GPT-2's initialisation: zero biases, small residual projections.
    assert torch.equal(a.transformer.h[0].mlp.c_fc.bias, torch.zeros(128))
    assert a.transformer.h[0].attn.c_proj.weight.std() < a.transformer.h[0].attn.c_attn.weight.std()


def test_forward_shapes():
    gpt = models.build("gradtap.workload.models:gpt2", TINY_GPT, seed=0)
    batch = gpt.synthetic_data(batch_size=2, seed=0, seq_len=5).batch(0, 0)
    assert gpt(batch.inputs).shape == (2, 5, 97)
    with pytest.raises(ConfigError, match="block_size"):
        gpt(torch.zeros(1, 17, dtype=torch.long))
    mlp = models.build("gradtap.workload.models:mlp", {"sizes": [8, 16, 4]}, seed=0)
    assert mlp(mlp.synthetic_data(batch_size=3, seed=0).batch(0, 0).inputs).shape == (3, 4)
    with pytest.raises(ConfigError, match="seq_len"):
        mlp.synthetic_data(batch_size=3, seed=0, seq_len=4)


@pytest.mark.parametrize("factory,match", [("gradtap.workload.models", "form"), ("no_such_module:x", "cannot import"),
                                           ("gradtap.workload.models:nothing", "no callable")])
def test_bad_factory(factory, match):
    with pytest.raises(ConfigError, match=match):
        models.build(factory, seed=0)


def test_bad_kwargs():
    with pytest.raises(ConfigError, match="model.kwargs"):
        models.build("gradtap.workload.models:gpt2", {"layers": 2}, seed=0)
    with pytest.raises(ConfigError, match="n_embd"):
        models.build("gradtap.workload.models:gpt2", dict(TINY_GPT, n_head=5), seed=0)
    with pytest.raises(ConfigError, match="sizes"):
        models.build("gradtap.workload.models:mlp", {"sizes": [8]}, seed=0)


def test_unused_parameter_is_refused():
    model = models.build("gradtap.workload.models:mlp", {"sizes": [4, 3]}, seed=0)
    model.spare = torch.nn.Parameter(torch.zeros(2))
    batch = Batch(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(PlanError, match="spare"):
        models.grad_ready_order(model, batch)


def test_describe_needs_synthetic_data():
    with pytest.raises(ConfigError, match="synthetic_data"):
        models.describe("torch.nn:Linear", {"in_features": 2, "out_features": 2})
