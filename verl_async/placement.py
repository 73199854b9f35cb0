"""Where the trainer's ranks and the engine replicas run: one placement-group bundle per node.

`trainer.nnodes` x `trainer.n_gpus_per_node` (and the same `rollout.*` keys) say how many nodes
and devices per node; a plan turns them into one bundle per node holding that node's members
(ranks or replicas) and their devices. One node: the bundle is one node by construction, so the
trainer's loopback rendezvous is right (STRICT_PACK). Several: STRICT_SPREAD puts each bundle
on a different node, so member i runs on node i // per_node and rank 0's node address is where
the others meet. `<group>.node_resource` names a Ray custom resource (`ray start
--resources='{"trainer": 1}'`): every bundle then asks for a sliver of it, so it lands only on
nodes that carry it.

Before anything is reserved, `NodePlan.problem` compares a plan with the cluster's nodes and
says in one line, naming the key, why it can never be placed (a reservation would otherwise
wait for its timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

# A bundle's claim on its node's custom resource: marks the node, reserves nothing that matters
# (a node started with {"trainer": 1} holds a thousand bundles).
NODE_SHARE = 0.001
_EPS = 1e-9


class PlacementError(RuntimeError):
    """A plan that the cluster cannot hold; `str()` is "<key>: <reason>", one line."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        super().__init__(f"{key}: {' '.join(reason.split())}")


def resources_of(options: Mapping[str, Any]) -> dict[str, float]:
    """Ray actor options (num_cpus, num_gpus, resources) as one resource dict."""
    out = {name: float(amount) for name, amount in (options.get("resources") or {}).items()}
    if options.get("num_cpus"):
        out["CPU"] = float(options["num_cpus"])
    if options.get("num_gpus"):
        out["GPU"] = float(options["num_gpus"])
    return out


def pin(node_resource: Optional[str]) -> dict[str, Any]:
    """Actor options that keep an actor on the nodes carrying `node_resource` (none: anywhere)."""
    return {"resources": {node_resource: NODE_SHARE}} if node_resource else {}


@dataclass(frozen=True)
class NodePlan:
    group: str  # "trainer" | "rollout": the config group whose nnodes / n_gpus_per_node / node_resource size it
    nnodes: int
    per_node: int  # members (ranks, replicas) on each node
    member: Mapping[str, float] = field(default_factory=dict)  # Ray resources of one member
    node_resource: Optional[str] = None

    @property
    def size(self) -> int:
        return self.nnodes * self.per_node

    @property
    def strategy(self) -> str:
        return "STRICT_PACK" if self.nnodes == 1 else "STRICT_SPREAD"

    def bundle(self) -> dict[str, float]:
        """One node's share: its members' resources, and a sliver of the node resource."""
        out = {name: amount * self.per_node for name, amount in self.member.items() if amount}
        if self.node_resource:
            out[self.node_resource] = NODE_SHARE
        return out

    def bundles(self) -> list[dict[str, float]]:
        return [self.bundle() for _ in range(self.nnodes)]

    def bundle_of(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.group} member {index} outside {self.nnodes} x {self.per_node}")
        return index // self.per_node

    def describe(self) -> str:
        return f"{self.nnodes} node(s) x {_fmt(self.bundle())}"

    def problem(self, nodes: Sequence[Mapping[str, float]]) -> Optional[PlacementError]:
        """Why the cluster's nodes (each node's total resources) can never hold this plan, or None."""
        bundle = self.bundle()
        fits = [n for n in nodes if all(n.get(name, 0.0) + _EPS >= amount for name, amount in bundle.items())]
        if len(fits) >= self.nnodes:
            return None
        g, res = self.group, self.node_resource
        if res and not any(n.get(res, 0.0) > 0 for n in nodes):
            return PlacementError(
                f"{g}.node_resource",
                f"no node of the cluster carries the Ray resource {res!r}; start the {g}'s nodes with "
                f"`ray start --address=... --resources='{{\"{res}\": 1}}'` (or set {g}.node_resource=null)")
        marked = [n for n in nodes if not res or n.get(res, 0.0) > 0]
        where = f"node(s) carrying {res!r}" if res else "node(s)"
        if not fits:
            largest = max(marked, key=lambda n: sum(n.get(k, 0.0) for k in bundle), default={})
            return PlacementError(
                f"{g}.n_gpus_per_node",
                f"{g}.n_gpus_per_node={self.per_node} needs one node holding {_fmt(bundle)}, but none of the "
                f"{len(marked)} {where} does (the largest has {_fmt({k: largest.get(k, 0.0) for k in bundle})})")
        return PlacementError(
            f"{g}.nnodes",
            f"{g}.nnodes={self.nnodes} needs {self.nnodes} distinct nodes each holding {_fmt(bundle)}; the cluster "
            f"has {len(fits)} such {where}; add nodes or lower {g}.nnodes")


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


# ------------------------------------------------------------------------------------ Ray
def _ray_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def alive_nodes() -> list[dict[str, float]]:
    """Each alive node's total resources."""
    return [dict(n.get("Resources", {})) for n in _ray_nodes()]


def where(members: str, nodes: Sequence[str]) -> str:
    """"ranks 0-3 on node A (id ..), rank 4 on node B (id ..)": member indices grouped by node
    (`members` is the plural: "ranks", "replicas")."""
    by_node: dict[str, list[int]] = {}
    for index, name in enumerate(nodes):
        by_node.setdefault(name, []).append(index)
    return ", ".join(f"{members if len(ix) > 1 else members[:-1]} {_indices(ix)} on {name}"
                     for name, ix in by_node.items())


def _indices(ix: list[int]) -> str:
    return f"{ix[0]}-{ix[-1]}" if len(ix) > 1 and ix == list(range(ix[0], ix[-1] + 1)) else ", ".join(map(str, ix))


def check_plans(plans: Sequence[NodePlan]) -> None:
    """Raise the first plan's PlacementError against this cluster, then the plans' together (a start-up check)."""
    nodes = alive_nodes()
    for plan in plans:
        found = plan.problem(nodes)
        if found is not None:
            raise found
    found = plans_problem(plans, nodes)
    if found is not None:
        raise found


def plans_problem(plans: Sequence[NodePlan], nodes: Sequence[Mapping[str, float]]) -> Optional[PlacementError]:
    """Why the plans can never be held at once although each fits alone, or None.

    Their bundles' sums per resource against the cluster's: a necessary condition, so it never refuses a layout
    that fits. It catches a split layout on too few devices (the trainer's and the rollout's GPUs on a one-GPU
    machine), which would otherwise wait out the second reservation's timeout with nothing said."""
    if len(plans) < 2:
        return None
    need: dict[str, float] = {}
    for plan in plans:
        for bundle in plan.bundles():
            for name, amount in bundle.items():
                need[name] = need.get(name, 0.0) + amount
    have = {name: sum(n.get(name, 0.0) for n in nodes) for name in need}
    short = {name: amount for name, amount in need.items() if amount > have[name] + _EPS}
    if not short:
        return None
    parts = " and ".join(f"the {p.group}'s {p.describe()}" for p in plans)
    keys = " + ".join(f"{p.group}.nnodes x {p.group}.n_gpus_per_node" for p in plans)
    return PlacementError(
        keys,
        f"{parts} need {_fmt(short)} together, but the cluster has {_fmt({k: have[k] for k in short})}"
        f"{_visible_devices_note()}; set rollout.colocate=true to share the trainer's devices, or use fewer")


def _visible_devices_note() -> str:
    import os

    shown = [f"{k}={os.environ[k]}" for k in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES") if k in os.environ]
    return f" ({', '.join(shown)})" if shown else ""


class Reservation:
    """A reserved placement group and its plan: where member i goes; `release()` when done."""

    def __init__(self, plan: NodePlan, pg: Any) -> None:
        self.plan = plan
        self.pg = pg

    def strategy(self, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.plan.bundle_of(index))

    def member_nodes(self) -> list[str]:
        """The node of each member, as messages name nodes ("node 10.0.0.2 (id 1a2b3c4d)")."""
        from ray.util import placement_group_table

        bundles = placement_group_table(self.pg)["bundles_to_node_id"]
        names = {n["NodeID"]: n.get("NodeName") or n.get("NodeManagerAddress") for n in _ray_nodes()}
        ids = [bundles[self.plan.bundle_of(i)] for i in range(self.plan.size)]
        return [f"node {names.get(i, '?')} (id {i[:8]})" for i in ids]

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone already
                pass
            self.pg = None


def reserve(plan: NodePlan, timeout_s: float) -> Reservation:
    """Reserve one bundle per node, waiting at most `timeout_s` (an impossible plan fails at once)."""
    import ray
    from ray.util.placement_group import placement_group

    from verl_async.utils.waiting import resolve

    found = plan.problem(alive_nodes())
    if found is not None:
        raise found
    reservation = Reservation(plan, placement_group(plan.bundles(), strategy=plan.strategy))
    try:
        resolve(reservation.pg.ready(), timeout_s)  # no ray.get: the Rollouter (an async actor) reserves too
    except ray.exceptions.GetTimeoutError:
        reservation.release()
        raise PlacementError(
            f"{plan.group}.nnodes",
            f"cannot reserve {plan.describe()} ({plan.strategy}) within {timeout_s:.0f} s: other work holds the "
            f"resources; available now: {_fmt(ray.available_resources())}") from None
    return reservation
