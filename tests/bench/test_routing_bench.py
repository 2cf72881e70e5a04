"""routing_bench's sizing and its ideal (single worker with all the memory) hit rate."""

from __future__ import annotations

from bench.routing_metrics import Record, ideal_hit_rate, queue_balance
from bench.routing_workload import BenchConfig, build_workload, sized


def record(prompt: list[int], output: list[int], started: float) -> Record:
    return Record(0.0, 0.0, len(prompt), 0, len(output), 0.0, "w", started, tuple(prompt), tuple(output))


def test_cache_fraction_sizes_the_cache_between_one_and_all_workers() -> None:
    config = BenchConfig(model_dir="", workers=2, conversations=8, turns=3, system_len=64, user_len=32,
                         max_tokens=8, cache_fraction=1.25)  # fmt: skip
    config, sizes = sized(config, build_workload(config))
    assert sizes["working_set_over_one_worker"] > 1 > sizes["working_set_over_all_workers"]
    assert config.num_kv_blocks == sizes["kv_blocks_per_worker"]


def test_ideal_hit_rate_is_an_lru_of_all_the_memory() -> None:
    a = list(range(3, 67))  # 4 blocks of 16
    b = list(range(100, 164))
    records = [record(a, [1] * 16, 0.0), record(b, [], 1.0), record(a + [1] * 16 + [5], [], 2.0)]
    # Enough memory: the third request finds a's 4 blocks and the output block (81 tokens: 5 blocks).
    assert ideal_hit_rate(records, 64, 16) == 80 / (64 + 64 + 81)
    # Room for 4 blocks only: b's blocks evicted a's, nothing is found.
    assert ideal_hit_rate(records, 4, 16) == 0.0


def test_queue_balance_reports_the_busiest_worker_over_the_mean() -> None:
    balance = queue_balance({"w0": [6, 6], "w1": [2, 2], "w2": [1, 1]})
    assert balance["busiest_over_mean"] == 6 / 3


def test_list_flags_are_split() -> None:
    from bench.routing_bench import parse_args

    config, _, plot = parse_args(
        ["--model-dir", "m", "--loads", "8,32", "--policies", "prefix,least_load", "--plot", "r.png"]
    )
    assert (config.loads, config.policies) == (("8", "32"), ("prefix", "least_load"))
    assert str(plot) == "r.png"


def test_policy_cost_times_every_turn() -> None:
    from bench.routing_bench import policy_cost

    config = BenchConfig(model_dir="", workers=2, conversations=4, turns=2, system_len=32, user_len=16,
                         max_tokens=2, num_kv_blocks=64)  # fmt: skip
    cost = policy_cost(config, build_workload(config), rounds=1)
    assert cost["count"] == 8 and 0 < cost["p50"] <= cost["p99"] <= cost["max"]
