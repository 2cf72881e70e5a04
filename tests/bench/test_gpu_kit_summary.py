"""The GPU kit's summary of figures only a GPU produces (here from a report's steps written
by hand): async scheduling against its sync row, one layer's projections at c=1 by
cuBLAS, by the better of cuBLAS and the Triton experiment, and merged, and the engine's
prefill attention against the one-launch experiment."""

from __future__ import annotations

from bench.gpu.kit import PROFILES, summarize


def _row(concurrency: int, tok_s: float) -> dict[str, object]:
    return {"concurrency": concurrency, "output_tok_per_s": tok_s, "tpot_ms": {}}


def test_gpu_only_ratios() -> None:
    rows_1 = {
        "q_or_o": {"cublas_us": 5.0, "best_us": 3.0},
        "k_or_v": {"cublas_us": 4.0, "best_us": 6.0},
        "gate_or_up": {"cublas_us": 10.0, "best_us": 9.0},
        "down": {"cublas_us": 12.0, "best_us": 10.0},
        "qkv_merged": {"cublas_us": 7.0},
        "gate_up_merged": {"cublas_us": 19.0},
    }
    steps = {
        "engine_graphs": {
            "status": "ok",
            "rows": [_row(1, 500.0), _row(256, 12_000.0)],
            "row_sync_scheduling": _row(256, 8_000.0),
            "top_p_rows": {
                "device": _row(64, 6_000.0),
                "candidates": _row(64, 4_000.0),
                "sort": _row(64, 5_000.0),
            },
        },
        "skinny_gemm": {"status": "ok", "shapes": {"rows_1": rows_1}},
        "norm_parity": {
            "status": "ok",
            "inductor_mean": {"graph_replay_ms": 1.2},
            "aten_mean": {"graph_replay_ms": 1.3},
            "first_diff": 40,
        },
        "top_p_sampler": {
            "status": "ok",
            "rows": {
                "64": {
                    "device_us": 30.0,
                    "candidates_us": 50.0,
                    "sort_us": 90.0,
                    "rows_differing_from_sort": 1,
                }
            },
        },
        "prefill_attention": {
            "status": "ok",
            "rows": {"fresh": {"per_chunk_us": 300.0, "one_launch_us": 200.0}},
        },
    }
    out = summarize(steps, PROFILES["gpu"])
    assert out["async_over_sync_scheduling_tok_s"] == 1.5
    assert out["top_p_sort_over_candidates_tok_s"] == 1.25
    assert out["top_p_device_over_candidates_tok_s"] == 1.5
    assert out["top_p_sampler_us"] == {"64": {"device_us": 30.0, "candidates_us": 50.0, "sort_us": 90.0}}
    assert out["top_p_sampler_rows_differing_from_sort"] == 1
    assert out["top_p_sampler_draws_outside_nucleus"] == 0
    assert out["c1_layer_projections_us"] == {
        "cublas": 2 * 5 + 2 * 4 + 2 * 10 + 12,
        "best_of_both": 2 * 3 + 2 * 4 + 2 * 9 + 10,
        "cublas_merged": 7 + 5 + 19 + 12,
    }
    assert out["prefill_attention_per_chunk_over_one_launch"] == {"fresh": 1.5}
    assert out["c1_norm_parity"] == {
        "replay_ms_inductor_mean": 1.2,
        "replay_ms_aten_mean": 1.3,
        "first_diff": 40,
    }


def test_sync_sites_counts_each_synchronising_call_at_its_frame_under_root() -> None:
    """The kit's sync-point probe (steps.sync_sites): warnings about synchronising calls are
    counted at the innermost frame under the root given; others are ignored; the debug mode
    is set around the call and reset after."""
    import warnings
    from pathlib import Path

    from bench.gpu.steps import sync_sites

    modes: list[int] = []

    def synchronising() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    def workload() -> None:
        for _ in range(3):
            synchronising()
        warnings.warn("something else", UserWarning, stacklevel=1)

    sites = sync_sites(workload, str(Path(__file__).parent), modes.append)
    assert modes == [1, 0]
    assert list(sites.values()) == [3]
    (place,) = sites
    assert place.startswith("test_gpu_kit_summary.py:") and place.endswith(" synchronising")


def test_gpu_idle_counts_the_gaps_between_steps_by_the_step_that_waited() -> None:
    from bench.gpu.steps import gpu_idle

    spans = [(0.0, 3.0, "graph"), (3.0, 6.0, "graph"), (8.0, 40.0, "eager"), (40.5, 44.0, "graph")]
    out = gpu_idle(spans)
    assert out["busy_ms"] == 3.0 + 3.0 + 32.0 + 3.5
    assert out["idle_ms"] == 2.5
    assert out["idle_before_ms"] == {"graph": 0.5, "eager": 2.0}
