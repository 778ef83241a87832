"""Ask every engine replica of a running app for its ReplicaReport (operators, tests, benchmarks)."""

from __future__ import annotations

from ray import serve

from .routing_stats import ReplicaReport


def replica_reports(app_name: str = "ponytail", replicas: int = 2, attempts: int = 80) -> dict[str, ReplicaReport]:
    """{actor name: ReplicaReport} from `replicas` different engine replicas; RuntimeError if fewer answer.

    Serve has no call to a chosen replica, so this calls `report` through the deployment's router
    until that many have answered. Both routers spread such calls: power of two by queue length,
    the KV-block router because each call routed since a replica's last stats report counts as
    load there. The reports are read one after another, not at one instant.
    """
    handle = serve.get_deployment_handle("EngineReplica", app_name=app_name)
    seen: dict[str, ReplicaReport] = {}
    for _ in range(attempts):
        report = handle.report.remote().result(timeout_s=60)
        seen[report.replica] = report
        if len(seen) >= replicas:
            return seen
    raise RuntimeError(f"{len(seen)} of {replicas} engine replicas of {app_name!r} answered "
                       f"{attempts} report calls: {sorted(seen)}")
