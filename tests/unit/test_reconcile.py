"""A host daemon's reconciliation (efdl.fleet.reconcile): agents started and stopped so that
each job runs on exactly the GPUs the allocator gave it here, in place."""

from __future__ import annotations

from efdl.fleet.reconcile import HostedAgent, Start, Stop, foreign, reconcile


def agent(job: str, gpus: set[int], pid: int, stopping: bool = False) -> HostedAgent:
    return HostedAgent(job, frozenset(gpus), pid, stopping)


def test_a_job_placed_here_gets_one_agent_per_gpu() -> None:
    assert reconcile({"llama": {3, 1, 2}}, []) == [
        Start("llama", (1,)),
        Start("llama", (2,)),
        Start("llama", (3,)),
    ]
    assert reconcile({"llama": []}, []) == []


def test_nothing_changes_when_the_agents_match() -> None:
    agents = [agent("a", {0}, 100), agent("a", {1}, 101), agent("b", {5}, 102)]
    assert reconcile({"a": {0, 1}, "b": {5}}, agents) == []


def test_a_job_that_grows_here_gets_agents_for_the_new_gpus_only() -> None:
    agents = [agent("a", {0}, 100), agent("a", {1}, 101)]
    assert reconcile({"a": {0, 1, 2, 3}}, agents) == [Start("a", (2,)), Start("a", (3,))]


def test_a_job_that_loses_a_whole_agent_stops_just_that_one() -> None:
    agents = [agent("a", {0, 1}, 100), agent("a", {2, 3}, 101)]
    assert reconcile({"a": {0, 1}}, agents) == [Stop(101, "a", "job a gave up GPU(s) 2,3 here")]


def test_a_shrink_stops_only_the_agents_of_the_gpus_given_up() -> None:
    agents = [agent("a", {g}, 100 + g) for g in range(4)]
    assert reconcile({"a": {0, 1}}, agents) == [
        Stop(102, "a", "job a gave up GPU(s) 2 here"),
        Stop(103, "a", "job a gave up GPU(s) 3 here"),
    ]


def test_an_agent_on_several_gpus_leaves_whole_and_its_kept_gpus_come_back_one_by_one() -> None:
    agents = [agent("a", {0, 1, 2, 3}, 100)]
    assert reconcile({"a": {0, 1}}, agents) == [Stop(100, "a", "job a gave up GPU(s) 2,3 here")]
    exiting = [agent("a", {0, 1, 2, 3}, 100, stopping=True)]
    assert reconcile({"a": {0, 1}}, exiting) == []  # its GPUs are still held
    assert reconcile({"a": {0, 1}}, []) == [Start("a", (0,)), Start("a", (1,))]


def test_a_gpu_moves_to_another_job_only_after_its_agent_has_exited() -> None:
    agents = [agent("low", {0}, 100), agent("low", {1}, 101)]
    actions = reconcile({"low": {0}, "high": {1}}, agents)
    assert actions == [Stop(101, "low", "job low gave up GPU(s) 1 here")]
    exiting = [agent("low", {0}, 100), agent("low", {1}, 101, stopping=True)]
    assert reconcile({"low": {0}, "high": {1}}, exiting) == []
    assert reconcile({"low": {0}, "high": {1}}, exiting[:1]) == [Start("high", (1,))]


def test_a_job_gone_from_this_host_has_its_agents_stopped() -> None:
    agents = [agent("a", {0}, 100), agent("b", {1}, 101)]
    assert reconcile({"b": {1}}, agents) == [Stop(100, "a", "job a holds no GPU here any more")]


def test_foreign_gpus_are_those_with_a_process_that_is_not_ours() -> None:
    processes = {0: [4001], 1: [4002, 9999], 2: [], 3: [5000]}
    assert foreign(processes, ours={4001, 4002}) == {1, 3}
