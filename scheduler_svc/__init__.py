"""Global scheduler: worker registry, admission queue, prefix/load-aware routing, failover."""
