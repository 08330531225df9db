"""Executors as Ray actors on a simulated cluster of two nodes (`ray.cluster_utils.Cluster`
on this machine, one per module): `ray:auto` inventories, every example pipeline with
stand-ins and omni chat on the tiny models across the nodes with outputs equal to the
interpreter's, net edges between them, a killed actor, a cancelled request. Skipped without
Ray (`pip install 'omniflow[ray]'`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from omniflow.compiler import compile_file, compile_source
from omniflow.devices import parse_devices
from omniflow.runtime.engine import Engine, EngineError, RequestFailed
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.shm_ring import SEGMENT_PREFIX, SHM_DIR
from tests.runtime.test_failures import CHAIN, cancel_mid_stream, kill_mid_stream
from tests.runtime.test_modes import REQUESTS, assert_same

ray = pytest.importorskip("ray")

GRAPHS = Path(__file__).parents[2] / "graphs"
# Per step of the test stages (tests/runtime/stages.py); the actors' processes inherit it
# from the cluster's, so it is set before the cluster starts.
STEP_DELAY_S = "0.01"
# Ray's `memory` is what a node's CPU device offers the compiler: room for the examples'
# real-size stages (stand-ins run them), far above what the stand-ins use.
NODE = {"num_cpus": 4, "memory": 256 << 30}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    before = os.environ.get("OMNIFLOW_TEST_DELAY")
    os.environ["OMNIFLOW_TEST_DELAY"] = STEP_DELAY_S
    nodes = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    nodes.add_node(**NODE)
    ray.init(address=nodes.address, include_dashboard=False, logging_level="ERROR")
    yield nodes
    ray.shutdown()
    nodes.shutdown()
    if before is None:
        os.environ.pop("OMNIFLOW_TEST_DELAY")
    else:
        os.environ["OMNIFLOW_TEST_DELAY"] = before


def _all_cpus_free() -> bool:
    """No executor actor holds a CPU of the cluster any more."""
    for _ in range(100):
        if ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]:
            return True
        time.sleep(0.1)
    return False


def _segments_of(pid: int) -> list[str]:
    return [p.name for p in SHM_DIR.glob(f"{SEGMENT_PREFIX}{pid}-*")]


def test_ray_auto_lists_the_clusters_nodes_head_first(cluster):
    devices = parse_devices("ray:auto")
    assert [d.name for d in devices] == ["node0/cpu", "node1/cpu"]
    head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
    assert devices[0].node_id == head and devices[1].node_id != head


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_examples_across_nodes_match_the_interpreter(cluster, name):
    plan = compile_file(GRAPHS / f"{name}.omni", devices="ray:auto")
    assert {d.name for d in plan.devices} == {"node0/cpu", "node1/cpu"}
    reference = Interpreter(plan, "standin")
    with Engine(plan, backends="standin") as engine:  # a ray:auto plan runs on Ray
        assert set(engine.executor_pids) == {p.name for p in plan.executors}
        for inputs, params in REQUESTS[name]:
            assert_same(engine.generate(inputs, params), reference.run(inputs, params))
    assert _all_cpus_free()


def test_omni_chat_on_tiny_models_across_nodes_matches_the_interpreter(cluster):
    plan = compile_file(GRAPHS / "omni_chat.omni", devices="ray:auto", tiny=True)
    assert any(c.kind == "net" for c in plan.channels)
    inputs, params = {"prompt": "hello"}, {"max_tokens": 3, "max_audio_tokens": 40, "seed": 7}
    want = Interpreter(plan).run(inputs, params)
    with Engine(plan) as engine:
        assert_same(engine.generate(inputs, params), want)


def _chain():
    # separate: one stage per node (CPU stages cost the placer nothing to put together)
    source = CHAIN.format(chunk=8, credits=2, batch=4).rstrip().removesuffix("}")
    source += "  separate src, dst\n}"
    plan = compile_source(source, "chain.omni", devices="ray:auto")
    edge = next(c for c in plan.channels if c.name == "src.out->dst.in")
    assert edge.kind == "net", "src and dst should be on two nodes"
    return plan


def test_a_killed_actor_fails_its_requests_naming_it_and_its_node_then_restarts(cluster):
    with Engine(_chain()) as engine:
        killed, error = kill_mid_stream(engine, "dst")  # streaming across the nodes
        assert "executor 'dst' (stages dst) on node1" in error and "died" in error
        out = engine.generate({"n": "20"})["out"]
        assert out.flatten().tolist() == [2 * i for i in range(20)]
        assert engine.executor_pids["dst"] != killed
        assert _segments_of(killed) == []
        pids = list(engine.executor_pids.values())
    assert all(_segments_of(pid) == [] for pid in pids)
    assert _all_cpus_free()


def test_cancel_mid_stream_across_nodes(cluster):
    with Engine(_chain()) as engine:
        cancel_mid_stream(engine)
        assert engine.generate({"n": "5"})["out"].flatten().tolist() == [0, 2, 4, 6, 8]
    assert _all_cpus_free()


def test_omniflow_run_once_on_the_cluster(cluster, tmp_path, capsys):
    from omniflow.cli import main

    code = main(["run", "--once", "graphs/omni_chat.omni", "--devices", "ray:auto", "--standin",
                 "--input", "prompt=hello", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "text.txt").read_text().startswith("w")
    assert (tmp_path / "audio.wav").stat().st_size > 44  # more than a WAV header
    assert _all_cpus_free()


def test_launch_with_ray_auto_runs_the_executors_as_actors(cluster):
    import omniflow

    with omniflow.launch(GRAPHS / "tts.omni", devices="ray:auto", backends="standin") as engine:
        audio = engine.generate({"text": "hi"})["audio"]
        for pid in engine.executor_pids.values():  # Ray's workers, not this process's children
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert parent != os.getpid()
    plan = compile_file(GRAPHS / "tts.omni", devices="ray:auto")
    assert_same(
        {"audio": audio}, {"audio": Interpreter(plan, "standin").run({"text": "hi"})["audio"]}
    )


# The engine's I/O thread ends by raising what stopped it (so that it is never silent).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_node_that_leaves_fails_its_requests_and_then_the_engine_saying_why(cluster):
    """Last in the module: it takes node1 away (and gives the cluster a new one after)."""
    with Engine(_chain()) as engine:
        stream = engine.stream_sync({"n": "400"})
        next(stream)
        cluster.remove_node(next(n for n in cluster.worker_nodes))
        with pytest.raises(RequestFailed, match="executor 'dst' .* on node1 .* died"):
            for _ in stream:
                pass
        with pytest.raises(EngineError, match="node1 has left the Ray cluster; compile again"):
            engine.generate({"n": "3"})
    assert _all_cpus_free()
    cluster.add_node(**NODE)
