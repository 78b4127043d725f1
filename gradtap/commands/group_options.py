"""The mirror-group flags ``gradtap replay`` and ``gradtap run`` share (``docs/group.md``):
``--group RANK/SIZE``, ``--rendezvous URL`` and ``--group-timeout SECONDS``, over the job
spec's ``appliance.mirror_group``.

Not a command: the modules of both commands import it (Click and the standard library only,
as a command module at the top).
"""

from __future__ import annotations

import click


def group_options(what: str):
    """The three flags, as one decorator; ``what`` says how a node takes its streams
    ("replaying", "capturing") in the help text."""
    def decorate(command):
        for option in reversed((
                click.option("--group", "group_at", metavar="RANK/SIZE",
                             help=f"this node is RANK of a mirror group of SIZE CPU nodes, each {what} its own "
                                  "streams of the job and stepping its shard of the replica (docs/group.md); "
                                  "default: the job's appliance.mirror_group"),
                click.option("--rendezvous", metavar="URL",
                             help="where the group's nodes meet: tcp://HOST:PORT (rank 0 listens) or file:///PATH "
                                  "(overrides appliance.mirror_group.rendezvous)"),
                click.option("--group-timeout", type=float, metavar="SECONDS",
                             help="longest wait for a peer; one silent this long is reported gone (default 60)"))):
            command = option(command)
        return command
    return decorate


def mirror_group(job, group_at: str | None, rendezvous: str | None, timeout: float | None):
    """The node's mirror group (``MirrorGroupSpec``) from ``--group RANK/SIZE``, ``--rendezvous``
    and ``--group-timeout`` over the job's ``appliance.mirror_group``; None when neither gives one."""
    from gradtap.workload.spec import parse_mirror_group

    spec = job.appliance.mirror_group
    if group_at is None and spec is None:
        if rendezvous or timeout:
            raise click.UsageError("--rendezvous and --group-timeout need --group RANK/SIZE (or the job's "
                                   "appliance.mirror_group)")
        return None
    fields = {} if spec is None else spec.model_dump()
    if group_at is not None:
        rank, slash, size = group_at.partition("/")
        if not slash or not rank.strip().isdigit() or not size.strip().isdigit():
            raise click.BadParameter(f"{group_at!r} is not RANK/SIZE, e.g. 0/3", param_hint="--group")
        fields.update(rank=int(rank), world_size=int(size))
    if rendezvous is not None:
        fields["rendezvous"] = rendezvous
    if timeout is not None:
        fields["timeout_s"] = timeout
    return parse_mirror_group(fields, "--group" if group_at else "appliance.mirror_group")


def refuse_for_group(given: dict[str, bool]) -> None:
    """A usage error naming the flags of ``given`` (flag -> given) a mirror-group node takes
    none of yet (they are not wired for shards: docs/group.md, Not done yet)."""
    named = [flag for flag, yes in given.items() if yes]
    if named:
        raise click.UsageError(f"--group: {', '.join(named)} {'is' if len(named) == 1 else 'are'} not wired for "
                               "mirror-group shards yet; run the node without "
                               f"{'it' if len(named) == 1 else 'them'} (docs/group.md, Not done yet)")
