"""Built-in models for simulated jobs, and what the wire planner needs to know about them.

A job names its model as ``"module:callable"`` plus keyword arguments (e.g.
``"gradtap.workload.models:gpt2"`` with ``{"n_layer": 2}``); :func:`build` resolves and calls
it under a fixed seed. The built-ins:

* :func:`mlp`: a ReLU multilayer perceptron on Gaussian features, the small fast job
  (the default ``sizes`` give about 1.06 M parameters);
* :func:`gpt2`: a GPT-2-small-like decoder (124.4 M parameters by default) in plain
  PyTorch: token + position embedding, pre-LayerNorm blocks of causal self-attention
  and a GELU (tanh) MLP, a final LayerNorm and a language-model head tied to the token
  embedding;
* :func:`flowcheck_testbed`: the same architecture at the shape FlowCheck's evaluation
  job used, scaled down to run on a CPU (see its docstring).

Parameter names follow Hugging Face's ``GPT2LMHeadModel`` (``transformer.h.0.attn.c_attn.weight``,
...), but weights are ``nn.Linear``'s ``[out, in]`` rather than HF ``Conv1D``'s
``[in, out]``, so a gradient's element order differs from an HF model's. There is no
dropout: each rank's gradient must be a pure function of the weights and its batch.

**Tied weights.** ``lm_head.weight`` *is* ``transformer.wte.weight``. ``named_parameters()``
(and so DDP, the optimizer and :func:`param_specs`) lists it once, as
``transformer.wte.weight``; its gradient sums both uses and becomes ready only when the
embedding's backward has run, near the very end of the backward pass.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradtap.core.errors import ConfigError, PlanError
from gradtap.workload.data import Batch, ClassificationData, TokenData, batch_loss
from gradtap.workload.spec import ParamSpec


class MLP(nn.Module):
    """``Linear(sizes[0], sizes[1]) → ReLU → … → Linear(sizes[-2], sizes[-1])``; logits
    ``[batch, sizes[-1]]`` from features ``[batch, sizes[0]]``."""

    def __init__(self, sizes: Sequence[int]):
        super().__init__()
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2 or min(sizes) < 1:
            raise ConfigError(f"sizes: {sizes} needs at least two positive layer widths")
        self.sizes = tuple(sizes)
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        self.layers = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def synthetic_data(self, *, batch_size: int, seed: int,
                       seq_len: int | None = None) -> ClassificationData:
        """Classification shards matching this model's input and output widths."""
        if seq_len is not None:
            raise ConfigError(f"seq_len: {seq_len} given, but the MLP takes no sequences")
        return ClassificationData(self.sizes[0], self.sizes[-1], batch_size, seed)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = FeedForward(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token ids ``[batch, seq]`` → logits ``[batch, seq, vocab]``."""

    def __init__(self, *, n_layer: int, n_head: int, n_embd: int, vocab_size: int,
                 block_size: int):
        super().__init__()
        for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd),
                            ("vocab_size", vocab_size), ("block_size", block_size)):
            if value < 1:
                raise ConfigError(f"{name}: {value} must be at least 1")
        if n_embd % n_head:
            raise ConfigError(f"n_embd: {n_embd} is not a multiple of n_head={n_head}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        # GPT-2's initialisation: N(0, 0.02) everywhere, the residual projections scaled
        # down by sqrt(2 * n_layer) so the residual stream's variance does not grow.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif name.endswith(".weight") and ".ln_" not in name:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias") and ".ln_" not in name:
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ConfigError(f"seq_len: {t} exceeds the model's block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def synthetic_data(self, *, batch_size: int, seed: int,
                       seq_len: int | None = None) -> TokenData:
        """Random-token shards; ``seq_len`` defaults to the model's ``block_size``."""
        return TokenData(self.vocab_size, seq_len or self.block_size, batch_size, seed)


def mlp(sizes: Sequence[int] = (512, 1024, 512, 10)) -> MLP:
    """The small, fast job: an MLP with layer widths ``sizes`` (inputs first, classes last)."""
    return MLP(sizes)


def gpt2(n_layer: int = 12, n_head: int = 12, n_embd: int = 768, vocab_size: int = 50257,
         block_size: int = 1024) -> GPT:
    """GPT-2 small by default (124,439,808 trainable parameters); shrink it with kwargs."""
    return GPT(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
               block_size=block_size)


def flowcheck_testbed(n_layer: int = 6, n_head: int = 8, n_embd: int = 512,
                      vocab_size: int = 50257, block_size: int = 128) -> GPT:
    """A stand-in for the job FlowCheck evaluated, sized for CPU training.

    FlowCheck's workload generator (``Workload_Gen/gpt_test.py`` in
    AlibabaResearch/flowcheck-eurosys25, commit a396bf8) trains Hugging Face
    ``GPT2LMHeadModel`` configurations from GPT-2 small (12 × 768) up to 40 × 4096 with
    vocabulary 50257, under default DDP buckets over 8 ranks, on 2 × 128-token batches of
    random ids, with ``Adam(lr=1e-4)``. This keeps that vocabulary (so the tied
    embedding, about 25.7 M elements, is larger than DDP's 25 MiB cap and fills a bucket
    on its own) and the 128-token context, and shrinks the stack to 6 × 512 (about
    44.9 M parameters) so a CPU iteration takes seconds.
    """
    return GPT(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
               block_size=block_size)


def resolve(factory: str) -> Callable[..., nn.Module]:
    """The callable named by ``"package.module:callable"``."""
    module_name, sep, attr = factory.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"model.factory: {factory!r} is not of the form 'module:callable'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model.factory: cannot import {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model.factory: {module_name!r} has no callable {attr!r}")
    return fn


def build(factory: str, kwargs: Mapping[str, Any] | None = None, *, seed: int,
          device: str | torch.device = "cpu") -> nn.Module:
    """Call the factory with ``kwargs`` under ``torch.manual_seed(seed)`` on ``device``.

    The global RNG state is restored afterwards. On the ``meta`` device no memory is
    allocated, which is enough for shapes and the gradient ready order.
    """
    fn = resolve(factory)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        try:
            model = fn(**dict(kwargs or {}))
        except (TypeError, ValueError) as e:      # a factory's own check of its arguments (sizes: abc)
            raise ConfigError(f"model.kwargs: {dict(kwargs or {})} do not fit {factory} ({e}); give the "
                              f"keyword arguments {factory} takes") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory: {factory} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def param_specs(model: nn.Module) -> tuple[ParamSpec, ...]:
    """DDP's parameter list for ``model``: trainable, deduplicated, in registration order."""
    return tuple(ParamSpec(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
                 for name, p in model.named_parameters() if p.requires_grad)


def grad_ready_order(model: nn.Module, batch: Batch) -> tuple[int, ...]:
    """Indices into :func:`param_specs` in the order their gradients become ready.

    Runs one forward and backward pass of :func:`gradtap.workload.data.batch_loss` and records
    when each parameter's gradient accumulator finishes, the event DDP's reducer hooks.
    Works on the ``meta`` device (shapes only). Leaves every ``.grad`` as ``None``.
    """
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    order: list[int] = []
    handles = [params[name].register_post_accumulate_grad_hook(
        lambda _p, i=i: order.append(i)) for i, name in enumerate(names)]
    try:
        batch_loss(model, batch).backward()
    finally:
        for handle in handles:
            handle.remove()
        for name in names:
            params[name].grad = None
    if sorted(order) != list(range(len(names))):
        unused = [names[i] for i in sorted(set(range(len(names))) - set(order))]
        raise PlanError(f"parameters {unused} get no gradient; DDP would need "
                        "find_unused_parameters=True, which gradtap does not model")
    return tuple(order)


def describe(factory: str, kwargs: Mapping[str, Any] | None = None, *,
             seq_len: int | None = None) -> tuple[tuple[ParamSpec, ...], tuple[int, ...]]:
    """``(param_specs, grad_ready_order)`` of a model, built on the meta device.

    Allocates nothing proportional to the model, so it suits GPT-2-sized jobs. The ready
    order comes from a one-sample batch; it depends on the graph, not the batch size.
    """
    model = build(factory, kwargs, seed=0, device="meta")
    if not hasattr(model, "synthetic_data"):
        raise ConfigError(f"model.factory: {factory} builds a model without synthetic_data(), "
                          "so its gradient ready order cannot be measured")
    batch = model.synthetic_data(batch_size=1, seed=0, seq_len=seq_len).batch(0, 0)
    return param_specs(model), grad_ready_order(model, batch.to("meta"))
