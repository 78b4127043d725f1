"""The job spec from the live trainer: ``describe(ddp_model, optimizer, scheduler)``.

An operator used to write the model, DDP, optimizer and NCCL sections of a job spec by hand;
the training script knows them all. Call it on rank 0 after DDP has rebuilt its buckets
(after the second training step; the third with ``static_graph=True``):

    doc = describe(ddp_model, optimizer, scheduler, name="gpt2-run")   # a dict, YAML-ready
    describe_to("job.yaml", ddp_model, optimizer, scheduler)            # merged into the file

Where each section comes from:

==============  ==============================================================================
``model``       the parameters DDP reduces (name, shape, dtype) in DDP's order; or, with
                ``factory=``, that import path and ``kwargs``, checked to build the same list
``ddp``         the live reducer's buckets after its rebuild (``layout: explicit``, names in
                launch order, each in buffer order), ``bucket_cap_mb``, and ``grad_dtype`` /
                ``predivide`` from the registered comm hook
``optimizer``   the Adam/AdamW ``param_groups`` (base ``lr``, ``betas``, ``eps``,
                ``weight_decay``, ``foreach``/``fused`` as torch resolves them) and the
                scheduler's schedule
``nccl``        the ``NCCL_*`` environment variables (:func:`nccl_section`) and
                ``torch.cuda.nccl.version()`` (``era``)
==============  ==============================================================================

What only the network knows stays the operator's, ``gradtap discover``'s or netconfig's:
``ring``, ``mirrors``, ``nccl.mtu`` (the port's active MTU; NCCL has no variable for it),
``nccl.channels`` unless ``NCCL_MIN_NCHANNELS`` = ``NCCL_MAX_NCHANNELS`` pins it,
``nccl.protocols`` and ``nccl.tuner``. :func:`describe_to` leaves those, and ``initial_state``,
``training`` and ``appliance``, as the file has them.

Everything read here is refused by name when gradtap's replica could not follow it: another
optimizer, per-group hyper-parameters, AMSGrad, a scheduler gradtap does not model, an unknown
comm hook, ``find_unused_parameters``, ``NCCL_ALGO`` allowing anything but Ring for allreduce.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from gradtap.core.errors import ConfigError
from gradtap.workload.buckets import MIB
from gradtap.workload.spec import (SUPPORTED_ERAS, DDPSpec, ModelSpec, NcclSpec,
                                   OptimizerSpec, Schedule, parse_job, read_job_document)

WIRE_DTYPE_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Comm hooks whose wire dtype is known, by name: torch's Python hooks in
# ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`` (recognised by identity, not
# by name) and the C++ builtins as DDP's logger names them (torch 2.13.0). Each divides by the
# world size before the allreduce. ``None``: the bucket's own dtype.
KNOWN_HOOKS = {"default_hooks.allreduce_hook": None, "default_hooks.fp16_compress_hook": "fp16",
               "default_hooks.bf16_compress_hook": "bf16", "BuiltinCommHookType.ALLREDUCE": None,
               "BuiltinCommHookType.FP16_COMPRESS": "fp16"}
# NCCL's names (src/init.cc ncclProtoStr, ncclAlgoStr, ncclFuncStr, v2.19.3-1 to v2.30.3-1), matched
# case-insensitively (strcasecmp in parseList, src/graph/tuning.cc).
NCCL_PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
NCCL_FUNCTIONS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")


def describe(ddp_model: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
             scheduler: Any = None, *, name: str, factory: str | None = None,
             kwargs: Mapping[str, Any] | None = None, trusted: bool = False, grad_dtype: str | None = None,
             predivide: bool | None = None, clip_grad_norm: float | None = None,
             environ: Mapping[str, str] | None = None) -> dict:
    """The ``name``, ``model``, ``ddp``, ``optimizer`` and ``nccl`` sections of a job spec.

    Parameters
    ----------
    ddp_model:
        The live ``DistributedDataParallel``, after its bucket rebuild (see the module docstring).
    optimizer, scheduler:
        ``torch.optim.Adam``/``AdamW`` over the DDP parameters, and ``None`` or the
        ``LambdaLR`` that :func:`optimizer_section` recognises.
    name:
        The job's name (letters, digits, ``_.-``).
    factory, kwargs, trusted:
        Write the model as ``factory(**kwargs)`` (``"package.module:callable"``) instead of
        its parameter list; it is built on the meta device and must give DDP's parameters.
        ``trusted`` is ``model.trusted`` for a factory outside the packages gradtap knows.
    grad_dtype, predivide:
        What a comm hook gradtap does not know puts on the wire (``fp32|bf16|fp16``, and
        whether it divides by the world size before the allreduce); read from the hook otherwise.
    clip_grad_norm:
        The ``max_norm`` the script passes to ``clip_grad_norm_`` before each step, if any:
        an optimizer does not know it.
    environ:
        The environment to read ``NCCL_*`` from; ``os.environ`` by default.

    Returns a plain dict (lists, strings, numbers) that ``yaml.safe_dump`` writes; with
    ``ring`` and ``mirrors`` added it is a job spec ``parse_job`` accepts, whose
    ``job_buckets`` are DDP's buckets. ``ConfigError`` names what gradtap cannot model.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError(f"ddp_model: a {type(ddp_model).__name__}, not a torch.nn.parallel.DistributedDataParallel; "
                          "describe reads the buckets of the live DDP wrapper")
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_.-" for c in name):
        raise ConfigError(f"name: {name!r} is not a job name (letters, digits, '_', '.', '-')")
    names = ddp_param_names(ddp_model)
    params = dict(ddp_model.module.named_parameters())
    return {"name": name,
           "model": model_section(ddp_model, factory=factory, kwargs=kwargs, trusted=trusted),
           "ddp": ddp_section(ddp_model, grad_dtype=grad_dtype, predivide=predivide),
           "optimizer": optimizer_section(optimizer, scheduler, params=[params[n] for n in names],
                                          clip_grad_norm=clip_grad_norm),
           "nccl": nccl_section(os.environ if environ is None else environ, nccl_version())}


def describe_to(path: str | Path, ddp_model: torch.nn.parallel.DistributedDataParallel,
                optimizer: torch.optim.Optimizer, scheduler: Any = None, *, name: str | None = None,
                **options: Any) -> dict:
    """Write :func:`describe`'s sections into the job spec at ``path``; the document written.

    When ``path`` exists, its ``model``, ``ddp`` and ``optimizer`` sections are replaced,
    its ``nccl`` section is updated key by key (a value describe could not determine,
    ``auto``, does not replace one the file has; ``mtu``, ``protocols``, ``tuner`` and
    ``channels`` when the environment does not pin them stay), and every other section
    (``ring``, ``mirrors``, ``initial_state``, ``training``, ``appliance``) stays as it
    is. ``name`` defaults to the file's, else the file's stem. A file with ``ring`` and
    ``mirrors`` must still parse as a job spec, or nothing is written; a new file holds
    describe's sections for the operator (or ``gradtap discover --job``) to complete. The
    file is replaced atomically; YAML comments in it are not kept. ``options`` are
    :func:`describe`'s.
    """
    import yaml

    path = Path(path)
    existing: dict = {}
    if path.exists():
        existing = read_job_document(path) or {}
        if not isinstance(existing, dict):
            raise ConfigError(f"{path}: a job spec is a YAML mapping, got {type(existing).__name__}")
    name = name or existing.get("name") or path.stem
    doc = describe(ddp_model, optimizer, scheduler, name=name, **options)
    merged = dict(existing, name=name, model=doc["model"], ddp=doc["ddp"], optimizer=doc["optimizer"])
    nccl = dict(existing.get("nccl") or {})
    for key, value in doc["nccl"].items():
        if not (value == "auto" and key in nccl):
            nccl[key] = value
    merged["nccl"] = nccl
    if "ring" in merged and "mirrors" in merged:
        parse_job(merged, str(path))
    text = "# model, ddp, optimizer and nccl written by gradtap.trainer.describe\n"
    text += yaml.safe_dump(merged, sort_keys=False)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return merged


# --- model -------------------------------------------------------------------------------------

def ddp_param_names(ddp_model: torch.nn.parallel.DistributedDataParallel) -> list[str]:
    """The names of the parameters DDP reduces, in its order (``_build_params_for_reducer``:
    trainable, deduplicated under their first name, registration order)."""
    if ddp_model.find_unused_parameters:
        raise ConfigError("ddp: find_unused_parameters=True: gradtap does not model parameters a step may leave "
                          "without a gradient (DDP then never rebuilds its buckets, and Adam skips them); "
                          "construct DDP without it")
    ignored = sorted(ddp_model.parameters_to_ignore)
    if ignored:
        raise ConfigError(f"ddp: parameters {ignored} are ignored by DDP (_ddp_params_and_buffers_to_ignore or "
                          "delay_all_reduce_named_params): their gradients are not in the buckets gradtap reads")
    if ddp_model.will_sync_module_buffers():
        buffers = sorted(ddp_model.named_module_buffers)
        shown = ", ".join(buffers[:5]) + (f" and {len(buffers) - 5} more" if len(buffers) > 5 else "")
        raise ConfigError(f"ddp: broadcast_buffers=True and the model has buffers ({shown}): DDP broadcasts them "
                          "from rank 0 before every forward over the gradients' NCCL communicator, and those "
                          "Broadcast calls share the ring's connections, which gradtap's wire plan does not model "
                          "(lock-on would fail); construct DDP with broadcast_buffers=False when the buffers are "
                          "equal on every rank or need no syncing (constant masks, positions)")
    return [n for n, p in ddp_model.module.named_parameters() if p.requires_grad]


def model_section(ddp_model: torch.nn.parallel.DistributedDataParallel, *, factory: str | None = None,
                  kwargs: Mapping[str, Any] | None = None, trusted: bool = False) -> dict:
    """``model``: DDP's parameter list, or ``factory`` + ``kwargs`` once they build the same list."""
    params = dict(ddp_model.module.named_parameters())
    live = [{"name": n, "shape": list(params[n].shape), "dtype": str(params[n].dtype).removeprefix("torch.")}
            for n in ddp_param_names(ddp_model)]
    if factory is None:
        return _validated("model", ModelSpec, {"params": live})
    section = _validated("model", ModelSpec, {"factory": factory, "kwargs": dict(kwargs or {}),
                                              **({"trusted": True} if trusted else {})})
    from gradtap.workload.models import build, param_specs     # builds the factory's model on the meta device

    built = [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype}
             for p in param_specs(build(factory, kwargs, seed=0, device="meta"))]
    if built != live:
        first = next((i for i, (a, b) in enumerate(zip(built, live)) if a != b), min(len(built), len(live)))
        got = built[first] if first < len(built) else "nothing"
        want = live[first] if first < len(live) else "nothing"
        raise ConfigError(f"model.factory: {factory}({dict(kwargs or {})}) builds {len(built)} parameters, DDP "
                          f"reduces {len(live)}; the first difference, at parameter {first}: the factory gives "
                          f"{got}, DDP has {want}")
    return section


# --- ddp ---------------------------------------------------------------------------------------

def ddp_buckets_of(ddp_model: torch.nn.parallel.DistributedDataParallel) -> list[list[str]]:
    """DDP's buckets as its reducer holds them: per bucket in launch (index) order, the names
    of its parameters in buffer order.

    Read from DDP's logging data (``rebuilt_per_bucket_param_indices``: indices into the
    reducer's parameter list, which DDP's logger records at the forward pass after the
    rebuild), or, in the iteration between the rebuild and that record, from the reducer's
    own ``GradBucket`` list (``_get_zeros_like_grad_buckets``, which allocates a zeroed copy
    of the bucket buffers for a moment). Before the rebuild the buckets are not yet the ones
    DDP keeps, and this refuses.
    """
    names = ddp_param_names(ddp_model)
    if not ddp_model._has_rebuilt_buckets:
        when = "third" if ddp_model.static_graph else "second"
        raise ConfigError(f"ddp: DDP has not rebuilt its buckets yet. It rebuilds them once, at the start of the "
                          f"{when} forward pass, from the order gradients became ready; the buckets before that are "
                          f"not the ones on the wire. Call describe after the {when} training step")
    logged = ddp_model._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if logged:
        reducer_params = ddp_model._build_params_for_reducer()[0]
        by_id = {id(p): n for n, p in ddp_model.module.named_parameters()}
        order = [by_id[id(p)] for p in reducer_params]
        buckets = [[order[int(i)] for i in bucket.split()] for bucket in logged.split(",")]
    else:
        by_id = {id(p): n for n, p in ddp_model.module.named_parameters()}
        grad_buckets = sorted(ddp_model.reducer._get_zeros_like_grad_buckets(), key=lambda b: b.index())
        buckets = [[by_id[id(p)] for p in b.parameters()] for b in grad_buckets]
    if sorted(n for b in buckets for n in b) != sorted(names):
        raise ConfigError(f"ddp: the reducer's buckets hold {sum(map(len, buckets))} parameters, DDP's list "
                          f"{len(names)}; describe does not understand this DDP")
    return buckets


def ddp_section(ddp_model: torch.nn.parallel.DistributedDataParallel, *, grad_dtype: str | None = None,
                predivide: bool | None = None) -> dict:
    """``ddp``: ``layout: explicit`` with :func:`ddp_buckets_of`, ``bucket_cap_mb`` (unset for
    DDP's default; unset too with ``bucket_cap_mb_list``, which the buckets already show),
    ``grad_dtype`` and ``predivide``."""
    buckets = ddp_buckets_of(ddp_model)
    dtypes = {p.dtype for p in ddp_model.module.parameters() if p.requires_grad}
    hooks = [_hook_name(h) for h, _ in ddp_model._comm_hooks]
    builtin = ddp_model._get_ddp_logging_data().get("comm_hook")
    if builtin and builtin.startswith("BuiltinCommHookType."):
        hooks.append(builtin)
    if len(hooks) > 1:
        raise ConfigError(f"ddp: several comm hooks {hooks}; DDP runs one")
    hook = hooks[0] if hooks else None
    if hook is None or hook in KNOWN_HOOKS:
        wire = KNOWN_HOOKS.get(hook)
        if wire is None:
            if len(dtypes) != 1 or next(iter(dtypes)) not in WIRE_DTYPE_OF:
                raise ConfigError(f"ddp.grad_dtype: parameters of dtypes {sorted(map(str, dtypes))} put no wire dtype "
                                  f"gradtap reads ({', '.join(WIRE_DTYPE_OF.values())}) on the wire")
            wire = WIRE_DTYPE_OF[next(iter(dtypes))]
        if grad_dtype is not None and grad_dtype != wire:
            raise ConfigError(f"ddp.grad_dtype: {grad_dtype!r} given, but the comm hook {hook or '(none)'} puts "
                              f"{wire!r} on the wire")
        if predivide is False:
            raise ConfigError(f"ddp.predivide: False given, but the comm hook {hook or '(none)'} divides by the "
                              "world size before the allreduce")
        grad_dtype, predivide = wire, True
    elif grad_dtype is None or predivide is None:
        raise ConfigError(f"ddp.grad_dtype: the comm hook {hook!r} is not one gradtap knows "
                          f"({', '.join(k for k in KNOWN_HOOKS)}); say what it puts on the wire with "
                          "describe(..., grad_dtype='fp32'|'bf16'|'fp16', predivide=True|False)")
    cap = None if ddp_model.bucket_bytes_cap_default or ddp_model.bucket_bytes_cap_list else \
        ddp_model.bucket_bytes_cap / MIB      # int(cap_mb * MIB) gives the bytes back exactly
    return _validated("ddp", DDPSpec, {"layout": "explicit", "buckets": buckets, "grad_dtype": grad_dtype,
                                       "predivide": predivide, **({"bucket_cap_mb": cap} if cap else {})})


def _hook_name(hook: Any) -> str:
    """``default_hooks.NAME`` for torch's own Python hooks, the qualified name of any other."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        if hook is getattr(default_hooks, name):
            return f"default_hooks.{name}"
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"


# --- optimizer ---------------------------------------------------------------------------------

# param_group keys that must agree across groups, and those gradtap's replica cannot follow when set.
_SHARED_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused", "capturable",
                "differentiable", "decoupled_weight_decay")
_REFUSED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def optimizer_section(optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
                      params: Sequence[torch.Tensor] | None = None, clip_grad_norm: float | None = None) -> dict:
    """``optimizer``: ``torch.optim.Adam``/``AdamW``'s hyper-parameters and the schedule.

    ``lr`` is the base learning rate (the scheduler's ``base_lrs``); ``implementation`` is
    the kernel torch runs (``fused``, ``foreach``, or, when both are ``None``, torch's own
    default for these parameters' devices: ``_default_to_fused_or_foreach``). ``scheduler``
    is ``None`` (constant) or ``LambdaLR(optimizer, functools.partial(
    gradtap.workload.schedule.lr_factor, schedule))``, the form gradtap's trainer and replica
    evaluate bit for bit; any other scheduler is refused by name. ``params``, when given, are
    DDP's parameters: the optimizer must step exactly those.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(f"optimizer: {type(optimizer).__module__}.{type(optimizer).__qualname__} is not "
                          "torch.optim.Adam or AdamW, the optimizers gradtap's replica steps")
    groups = optimizer.param_groups
    first = groups[0]
    def value(group: dict, key: str) -> Any:    # a scheduler keeps the base lr as initial_lr
        return _plain(group.get("initial_lr", group["lr"]) if key == "lr" else group.get(key))

    for i, g in enumerate(groups[1:], 1):
        for key in _SHARED_KEYS:
            a, b = value(g, key), value(first, key)
            if a != b:
                raise ConfigError(f"optimizer.{key}: param_groups[{i}] has {a!r}, param_groups[0] {b!r}; gradtap's "
                                  "optimizer section has one value for every parameter")
    for key in _REFUSED_FLAGS:
        if first.get(key):
            raise ConfigError(f"optimizer.{key}: True is not modelled by gradtap's replica (plain Adam/AdamW)")
    if params is not None:
        stepped = {id(p) for g in groups for p in g["params"]}
        wanted = {id(p) for p in params}
        if stepped != wanted:
            raise ConfigError(f"optimizer: steps {len(stepped)} parameters, DDP reduces {len(wanted)} "
                              f"({len(wanted - stepped)} of DDP's not stepped, {len(stepped - wanted)} not DDP's); "
                              "build it over ddp_model.parameters()")
    all_params = [p for g in groups for p in g["params"]]
    lr = first["lr"]
    if first.get("fused"):
        implementation = "fused"
    elif first.get("foreach"):
        implementation = "foreach"
    elif first.get("foreach") is None and first.get("fused") is None:
        from torch.optim.optimizer import _default_to_fused_or_foreach     # what Adam.step decides (adam.py)

        foreach = _default_to_fused_or_foreach(all_params, False, use_fused=False)[1]
        implementation = "foreach" if foreach and not isinstance(lr, torch.Tensor) else "single_tensor"
    else:
        implementation = "single_tensor"
    base_lr, schedule = _schedule(optimizer, scheduler)
    section = {"kind": "adamw" if first.get("decoupled_weight_decay") else "adam", "lr": base_lr,
               "betas": [float(b) for b in first["betas"]], "eps": float(first["eps"]),
               "weight_decay": float(first["weight_decay"]), "implementation": implementation,
               "schedule": schedule}
    if clip_grad_norm is not None:
        section["clip_grad_norm"] = float(clip_grad_norm)
    return _validated("optimizer", OptimizerSpec, section)


def _schedule(optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[float, dict]:
    """``(base lr, schedule section)``."""
    from gradtap.workload.schedule import lr_factor

    first = optimizer.param_groups[0]
    if scheduler is None:
        lr, initial = _plain(first["lr"]), _plain(first.get("initial_lr", first["lr"]))
        if lr != initial:
            raise ConfigError(f"optimizer.schedule: the optimizer's lr {lr} is not its initial_lr {initial}: a "
                              "learning-rate scheduler drives it; pass it as describe(..., scheduler)")
        return float(lr), {"kind": "constant"}
    kind = f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"
    if type(scheduler) is not torch.optim.lr_scheduler.LambdaLR:
        raise ConfigError(f"optimizer.schedule: scheduler {kind} is not one gradtap models (kinds constant, "
                          "warmup_cosine); express the schedule as LambdaLR(optimizer, functools.partial("
                          "gradtap.workload.schedule.lr_factor, Schedule(...)))")
    if scheduler.optimizer is not optimizer:
        raise ConfigError("optimizer.schedule: the scheduler drives another optimizer than the one given")
    found = []
    for fn in scheduler.lr_lambdas:
        if not (isinstance(fn, functools.partial) and fn.func is lr_factor and len(fn.args) == 1 and not fn.keywords):
            raise ConfigError(f"optimizer.schedule: LambdaLR with lr_lambda {getattr(fn, '__qualname__', fn)!r}, "
                              "whose learning rates gradtap cannot read; use functools.partial("
                              "gradtap.workload.schedule.lr_factor, Schedule(...)) as the lambda")
        s = fn.args[0]
        found.append(Schedule.model_validate(s.model_dump() if isinstance(s, BaseModel) else s))
    if any(s != found[0] for s in found[1:]):
        raise ConfigError("optimizer.schedule: the param_groups follow different schedules; gradtap models one")
    if any(_plain(b) != _plain(scheduler.base_lrs[0]) for b in scheduler.base_lrs):
        raise ConfigError(f"optimizer.lr: the param_groups' base learning rates {scheduler.base_lrs} differ; "
                          "gradtap models one")
    return float(_plain(scheduler.base_lrs[0])), found[0].model_dump(mode="json")


# --- nccl --------------------------------------------------------------------------------------

def nccl_version() -> tuple[int, int, int] | None:
    """``torch.cuda.nccl.version()`` where CUDA and NCCL exist, else ``None``."""
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return None
    v = torch.cuda.nccl.version()
    if isinstance(v, int):                # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9
        return v // 10000, v // 100 % 100, v % 100
    return tuple(int(x) for x in v[:3])


def nccl_section(environ: Mapping[str, str], version: Sequence[int] | None) -> dict:
    """``nccl`` from ``NCCL_*`` variables and NCCL's ``version`` (``None``: ``era: auto``).

    Variables are NCCL's own (``NCCL_PARAM(name, "X", default)`` reads ``NCCL_X``, parsed
    with ``strtoll(str, NULL, 0)``: src/misc/param.cc); a variable left unset is not written,
    so the job spec's default (NCCL 2.19's, or the era's) applies:

    * ``NCCL_PROTO`` → ``protocol`` when it leaves allreduce exactly one protocol, else
      ``auto`` (src/graph/tuning.cc ``parseList``: a comma list, ``^`` excludes; from 2.24
      also ``;``-separated ``function:list`` entries);
    * ``NCCL_ALGO`` must leave allreduce Ring alone (refused otherwise; a warning when it is
      unset, since NCCL may then pick Tree, NVLS or CollNet, which gradtap does not read);
    * ``NCCL_IB_QPS_PER_CONNECTION`` (default 1), ``NCCL_IB_SPLIT_DATA_ON_QPS`` (1 in 2.19,
      0 from 2.20), ``NCCL_IB_ADAPTIVE_ROUTING`` (-2: on for InfiniBand only),
      ``NCCL_IB_AR_THRESHOLD`` (8192) (src/transport/net_ib.cc);
    * ``NCCL_MIN_NCHANNELS`` = ``NCCL_MAX_NCHANNELS`` (or the legacy ``NCCL_MIN_NRINGS``/
      ``NCCL_MAX_NRINGS``, which the new names override) → ``channels`` (src/graph/connect.cc);
    * ``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE`` → ``buffsize`` of
      Simple, LL, LL128 (src/init.cc ``computeBuffSizes``);
    * ``NCCL_NTHREADS`` (Simple and LL) or ``NCCL_LL128_NTHREADS`` → ``nthreads`` for the one
      pinned protocol (src/graph/tuning.cc ``ncclTopoTuneModel``);
    * ``NCCL_IB_OOO_RQ`` (2.30, src/transport/net_ib/init.cc) → ``ib_ooo_rq``, which the spec refuses.
    """
    env = {k: v for k, v in environ.items() if k.startswith("NCCL_")}
    out: dict[str, Any] = {"era": _era(version)}
    algos = _allreduce_choice(env, "NCCL_ALGO", NCCL_ALGORITHMS)
    if algos is None:
        warnings.warn("NCCL_ALGO is unset: NCCL may run allreduce as Tree, NVLS or CollNet, which gradtap does not "
                      "read; run the trainer with NCCL_ALGO=Ring", stacklevel=3)
    elif algos != {"Ring"}:
        raise ConfigError(f"NCCL_ALGO: {env['NCCL_ALGO']!r} allows {sorted(algos)} for allreduce; gradtap reads "
                          "ring allreduce only: set NCCL_ALGO=Ring")
    protos = _allreduce_choice(env, "NCCL_PROTO", NCCL_PROTOCOLS)
    if protos is not None and not protos:
        raise ConfigError(f"NCCL_PROTO: {env['NCCL_PROTO']!r} leaves allreduce no protocol")
    out["protocol"] = next(iter(protos)) if protos is not None and len(protos) == 1 else "auto"
    for var, key, convert in (("NCCL_IB_QPS_PER_CONNECTION", "qps_per_connection", int),
                              ("NCCL_IB_SPLIT_DATA_ON_QPS", "split_data_on_qps", bool),
                              ("NCCL_IB_ADAPTIVE_ROUTING", "adaptive_routing", bool),
                              ("NCCL_IB_AR_THRESHOLD", "ar_threshold", int),
                              ("NCCL_IB_OOO_RQ", "ib_ooo_rq", bool)):
        if var in env:
            out[key] = convert(_integer(env, var))
    low = _integer(env, "NCCL_MIN_NCHANNELS", _integer(env, "NCCL_MIN_NRINGS"))
    high = _integer(env, "NCCL_MAX_NCHANNELS", _integer(env, "NCCL_MAX_NRINGS"))
    if low is not None and low == high:
        out["channels"] = low
    sizes = {proto: _integer(env, var) for proto, var in (("Simple", "NCCL_BUFFSIZE"), ("LL", "NCCL_LL_BUFFSIZE"),
                                                          ("LL128", "NCCL_LL128_BUFFSIZE"))}
    if any(v is not None for v in sizes.values()):
        out["buffsize"] = {p: v for p, v in sizes.items() if v is not None}
    threads = {var: _integer(env, var) for var in ("NCCL_NTHREADS", "NCCL_LL128_NTHREADS")}
    if any(v is not None for v in threads.values()):
        if out["protocol"] == "auto":
            raise ConfigError(f"nccl.nthreads: {', '.join(k for k, v in threads.items() if v is not None)} set while "
                              "NCCL_PROTO leaves several protocols; the spec's nthreads holds for every protocol and "
                              "NCCL's variables do not (NCCL_NTHREADS: Simple and LL, NCCL_LL128_NTHREADS: LL128): "
                              "pin NCCL_PROTO or unset them")
        var = "NCCL_LL128_NTHREADS" if out["protocol"] == "LL128" else "NCCL_NTHREADS"
        if threads[var] is not None:
            out["nthreads"] = threads[var]
    return _validated("nccl", NcclSpec, out)


def _era(version: Sequence[int] | None) -> str:
    if version is None:
        return "auto"
    major, minor = int(version[0]), int(version[1])
    era = "2.19" if (major, minor) == (2, 18) else f"{major}.{minor}"     # 2.19's facts cover 2.18.x
    if era not in SUPPORTED_ERAS:
        raise ConfigError(f"nccl.era: NCCL {'.'.join(map(str, version))} is not a release gradtap reads "
                          f"({SUPPORTED_ERAS[0]} to {SUPPORTED_ERAS[-1]}, 2.19 also covering 2.18.x)")
    return era


def _allreduce_choice(env: Mapping[str, str], var: str, elems: Sequence[str]) -> set[str] | None:
    """What ``var`` (an NCCL_PROTO/NCCL_ALGO list) enables for AllReduce; ``None`` when unset."""
    text = env.get(var)
    if text is None:
        return None
    enabled = set(elems)
    for i, entry in enumerate(text.split(";")):
        prefix, sep, items = entry.rpartition(":")
        if not sep and i > 0:
            raise ConfigError(f"{var}: {text!r}: every entry but the first needs a 'function:' prefix "
                              "(NCCL refuses it)")
        if sep and prefix.lower() not in (f.lower() for f in NCCL_FUNCTIONS):
            raise ConfigError(f"{var}: {text!r}: {prefix!r} is not one of NCCL's functions {list(NCCL_FUNCTIONS)}")
        if sep and prefix.lower() != "allreduce":
            continue
        exclude = items.startswith("^")
        named = set()
        for token in filter(None, items.removeprefix("^").split(",")):
            match = [e for e in elems if e.lower() == token.strip().lower()]
            if not match:
                raise ConfigError(f"{var}: {text!r}: {token!r} is not one of {list(elems)}")
            named.add(match[0])
        enabled = set(elems) - named if exclude else named
    return enabled


def _integer(env: Mapping[str, str], var: str, default: int | None = None) -> int | None:
    if var not in env:
        return default
    try:
        return int(env[var].strip(), 0)
    except ValueError:
        raise ConfigError(f"{var}: {env[var]!r} is not an integer") from None


# --- shared ------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """Tensors (a tensor lr or betas) as Python numbers, tuples as lists, for comparing."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _validated(section: str, spec: type[BaseModel], data: dict) -> dict:
    """``data`` checked by the job spec's own model; the keys given, JSON-ready."""
    try:
        return spec.model_validate(data).model_dump(mode="json", exclude_unset=True, exclude_none=True)
    except ValidationError as err:
        lines = [f"  {section}." + ".".join(map(str, e['loc'])) + f": {e['msg'].removeprefix('Value error, ')}"
                 for e in err.errors()]
        raise ConfigError("describe: the trainer's job spec would not validate\n" + "\n".join(lines)) from None
