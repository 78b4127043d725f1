"""netconfig: from a cluster topology to switch mirroring that gradtap can rely on.

- :mod:`netconfig.topology` / :mod:`netconfig.rail_fabric`: the topology file, validated;
- :mod:`netconfig.layout`, :mod:`netconfig.ring`: ranks, DP groups, and which allgather chunks a
  mirrored stream carries (NCCL's ring order);
- :mod:`netconfig.reliability`: FlowCheck Eq. (2) and the exact coverage model;
- :mod:`netconfig.planner` -> :mod:`netconfig.plan`: mirror sources and CPU-node ports;
- :mod:`netconfig.report`, :mod:`netconfig.render` with :mod:`netconfig.vendors`: report and configs;
- :mod:`netconfig.linux_mirror`: the plan applied on Linux through netlink.

See docs/netconfig.md.
"""
