"""The placement check before deploying (deploy/placement.py): what the workers ask for
against what each node has, and whether the cluster's autoscaler may add nodes. Pure
functions; the real Ray's side is in tests/deploy/test_placement_ray.py."""

from __future__ import annotations

import math

import pytest

from kvserve.deploy.config import ServeConfig
from kvserve.deploy.placement import (
    Demand,
    Node,
    autoscaler_can_add_nodes,
    demand_of,
    demands_of,
    fit_count,
    held_at_once,
    unplaceable,
)

CPU2 = Node("127.0.0.1", {"CPU": 2.0, "memory": 8e9, "node:__internal_head__": 1.0})


def test_three_one_cpu_workers_on_two_cpus_name_the_numbers_and_the_ways_out():
    why = unplaceable(demand_of(ServeConfig(num_workers=3)), [CPU2])
    assert why is not None
    assert why.startswith("3 workers need {CPU: 1} each, and the nodes hold 2 at once; "
                          "the nodes have 127.0.0.1 {CPU: 2}. Ways out: ")
    ways = why.split("Ways out: ")[1].split("; ")
    assert ways[:2] == ["--workers 2", "--cpus-per-worker 0.66"]
    assert "more or larger nodes" in ways[-1]
    # each way out does hold them
    assert held_at_once({"CPU": 0.66}, [CPU2], 3) == 3
    assert unplaceable(demand_of(ServeConfig(num_workers=2)), [CPU2]) is None
    assert unplaceable(demand_of(ServeConfig(num_workers=3, num_cpus_per_worker=0.66)),
                       [CPU2]) is None


def test_a_worker_fits_one_node_or_none_never_the_sum():
    nodes = [Node("a", {"CPU": 8, "GPU": 2}), Node("b", {"CPU": 8, "GPU": 2})]
    tp4 = demand_of(ServeConfig(num_workers=1, tensor_parallel_size=4, num_gpus_per_worker=4))
    assert tp4.bundle == {"CPU": 1.0, "GPU": 4.0}
    why = unplaceable(tp4, nodes)  # 4 GPUs in the cluster, never 4 on one node
    assert why.startswith("no node can hold one worker, which needs {CPU: 1, GPU: 4} on one "
                          "node (its 4 tensor-parallel ranks' devices together)")
    assert "a {CPU: 8, GPU: 2}, b {CPU: 8, GPU: 2}" in why
    assert "a smaller --tensor-parallel-size (the most GPUs on one node: 2)" in why
    assert "--workers" not in why and "--gpus-per-worker" not in why  # tp fixes the GPUs
    tp2 = demand_of(ServeConfig(num_workers=2, tensor_parallel_size=2, num_gpus_per_worker=2))
    assert unplaceable(tp2, nodes) is None


def test_gpu_workers_share_gpus_or_run_on_cpu():
    gpu2 = [Node("g", {"CPU": 16, "GPU": 2})]
    why = unplaceable(Demand(4, {"CPU": 1, "GPU": 1}), gpu2)
    assert "--workers 2" in why and "--gpus-per-worker 0.5 (workers share a GPU)" in why
    why = unplaceable(Demand(1, {"CPU": 1, "GPU": 1}), [CPU2])  # a CPU-only cluster
    assert why.startswith("no node can hold one worker, which needs {CPU: 1, GPU: 1}")
    assert "--gpus-per-worker 0 (CPU workers: no node has a GPU)" in why


def test_prefill_and_decode_workers_are_checked_per_role_and_together():
    gpu4 = [Node("g", {"CPU": 16, "GPU": 4})]
    same = ServeConfig(prefill_workers=2, decode_workers=3, num_gpus_per_worker=1)
    demands = demands_of(same)
    assert [(d.role, d.num_workers) for d in demands] == [("prefill", 2), ("decode", 3),
                                                          ("both", 5)]
    assert [unplaceable(d, gpu4) is None for d in demands] == [True, True, False]
    why = unplaceable(demands[2], gpu4)
    assert why.startswith("5 prefill and decode workers need {CPU: 1, GPU: 1} each")
    assert "fewer --prefill-workers and --decode-workers (4 in all)" in why
    # a prefill worker over 2 GPUs (tensor-parallel 2) beside decode workers of 1
    tp = ServeConfig(prefill_workers=1, decode_workers=1, prefill_tensor_parallel_size=4,
                     prefill_gpus_per_worker=4, num_gpus_per_worker=1)
    pre, dec = demands_of(tp)
    assert (pre.bundle, pre.tensor_parallel_size) == ({"CPU": 1.0, "GPU": 4.0}, 4)
    assert dec.bundle == {"CPU": 1.0, "GPU": 1.0}
    nodes = [Node("a", {"CPU": 8, "GPU": 2}), Node("b", {"CPU": 8, "GPU": 2})]
    why = unplaceable(pre, nodes)
    assert why.startswith("no node can hold one prefill worker, which needs {CPU: 1, GPU: 4}")
    assert "a smaller --prefill-tensor-parallel-size" in why
    assert unplaceable(dec, nodes) is None


def test_custom_resources_are_compared_like_cpus_and_gpus():
    nodes = [Node("x", {"CPU": 4, "accelerator_type:H100": 1}), Node("y", {"CPU": 4})]
    bundle = {"CPU": 1, "accelerator_type:H100": 0.001}
    assert fit_count(bundle, nodes[0].resources) == 4 and fit_count(bundle, nodes[1].resources) == 0
    assert unplaceable(Demand(4, bundle), nodes) is None
    why = unplaceable(Demand(5, bundle), nodes)
    assert "the nodes hold 4 at once" in why
    assert "x {CPU: 4, accelerator_type:H100: 1}, y {CPU: 4, accelerator_type:H100: 0}" in why


def test_workers_that_reserve_nothing_always_fit():
    assert fit_count({}, {}) == math.inf
    assert unplaceable(demand_of(ServeConfig(num_workers=64, num_cpus_per_worker=0)), [CPU2]) is None
    assert unplaceable(Demand(1, {"CPU": 1}), []).startswith("no node can hold one worker")


def test_many_nodes_are_summed_up_in_the_message():
    nodes = [Node(f"10.0.0.{i}", {"CPU": 1}) for i in range(9)]
    why = unplaceable(Demand(10, {"CPU": 1}), nodes)
    assert "the nodes hold 9 at once" in why and "and 3 more" in why
    assert "--cpus-per-worker 0.5" in why  # the largest share with which 10 fit 9 nodes


def _report(*node_types: str, pending: dict | None = None) -> dict:
    return {"autoscaler_report": {
        "active_nodes": {t: 1 for t in node_types}, "pending_launches": pending or {},
        "node_type_mapping": {f"ip{i}": t for i, t in enumerate(node_types)}}}


@pytest.mark.parametrize(("status", "v2", "expected"), [
    # Ray's read-only monitor (a local Ray, `ray start`): node types named after the nodes
    (_report("node_" + "ab12" * 14), False, False),
    (_report("node_" + "ab12" * 14, "node_" + "cd34" * 14), False, False),
    # a real autoscaler reports its configuration's node types
    (_report("headgroup"), False, True),
    (_report("ray.head.default", pending={"gpu-workers": 1}), False, True),
    # not reported yet: cannot tell
    (None, False, None),
    ({"load_metrics_report": {}}, False, None),
    # autoscaler v2 runs only where one is configured
    (None, True, True),
])
def test_whether_the_autoscaler_may_add_nodes(status, v2, expected):
    assert autoscaler_can_add_nodes(status, v2) is expected
