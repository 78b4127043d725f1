"""A job spec names code that runs: its model factory. Only model packages are taken as they
are; other modules need ``model.trusted: true``; the standard library never."""

from __future__ import annotations

import pytest

from gradtap.core.errors import ConfigError
from gradtap.workload.spec import parse_job

RANKS = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:01:{i + 1:02x}"} for i in range(2)]


def spec(**model):
    return {"name": "trust", "model": model, "optimizer": {"kind": "adam", "lr": 1e-3}, "ring": {"ranks": RANKS},
            "mirrors": [{"name": "m", "rank": 0, "direction": "egress"}]}


@pytest.mark.parametrize("factory", ["subprocess:run", "os:system", "builtins:eval", "importlib:import_module",
                                     "pickle:loads", "shutil.rmtree:x"])
def test_the_standard_library_is_refused_even_when_trusted(factory):
    for trusted in (False, True):
        with pytest.raises(ConfigError, match="standard library"):
            parse_job(spec(factory=factory, trusted=trusted), "job.yaml")


def test_an_unknown_module_needs_trusted():
    with pytest.raises(ConfigError, match=r"set model\.trusted: true"):
        parse_job(spec(factory="tests.simulator.naive_ddp:shuffled"), "job.yaml")
    job = parse_job(spec(factory="tests.simulator.naive_ddp:shuffled", trusted=True), "job.yaml")
    assert job.model.trusted


@pytest.mark.parametrize("factory", ["gradtap.workload.models:mlp", "torch.nn:Linear", "torchvision.models:resnet18",
                                     "transformers:GPT2LMHeadModel"])
def test_model_packages_need_nothing(factory):
    assert parse_job(spec(factory=factory), "job.yaml").model.factory == factory


def test_a_lookalike_of_a_model_package_is_not_one():
    with pytest.raises(ConfigError, match="trusted"):
        parse_job(spec(factory="gradtap.workload.models_evil:mlp"), "job.yaml")
