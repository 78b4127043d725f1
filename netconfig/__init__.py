"""netconfig: from a cluster topology to switch mirroring that gradtap can rely on.

- :mod:`gradtap.netconfig.topology`: the topology file, validated; its hardware records are in
  :mod:`gradtap.netconfig.hardware`, which :mod:`gradtap.netconfig.rail_fabric` also generates;
- :mod:`gradtap.netconfig.layout`, :mod:`gradtap.netconfig.ring`: ranks, DP groups, and which allgather chunks a
  mirrored stream carries (NCCL's ring order);
- :mod:`gradtap.netconfig.reliability`: FlowCheck Eq. (2) and the exact coverage model;
- :mod:`gradtap.netconfig.planner` -> :mod:`gradtap.netconfig.plan`: mirror sources and CPU-node ports,
  one node per DP group or several (a mirror group); :mod:`gradtap.netconfig.job_specs`: the
  appliances' job-spec sections, per group and per node with its ``appliance.mirror_group``;
  :mod:`gradtap.netconfig.encapsulation`: what ERSPAN adds to a mirrored frame;
- :mod:`gradtap.netconfig.cost`: the daily cost of the plan against ordinary checkpoints;
- :mod:`gradtap.netconfig.report`, :mod:`gradtap.netconfig.render` with :mod:`gradtap.netconfig.vendors`: report and configs;
- :mod:`gradtap.netconfig.linux_mirror`: the plan applied on Linux through netlink.

See docs/netconfig.md.
"""
