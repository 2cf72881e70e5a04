"""The launcher's services and their environment: its own settings, then `extra_env` on top;
scheduler replicas, `--only`, and the command line's validation."""

from __future__ import annotations

import pytest

from launcher.mesh import BackoffPolicy, MeshConfig, ServiceSpec, _parse, service_specs
from services import cpus


def _env(config: MeshConfig, name: str) -> dict[str, str]:
    [spec] = [s for s in service_specs(config, "redis://127.0.0.1:6379/0") if s.name == name]
    return spec.env


def test_stream_interval_reaches_the_decoders() -> None:
    config = MeshConfig(model_dir="/m", embedding_model_dir="", num_decoders=2, stream_interval=8)
    assert _env(config, "decoder-0")["MESHSERVE_STREAM_INTERVAL"] == "8"
    assert _env(config, "decoder-1")["MESHSERVE_STREAM_INTERVAL"] == "8"


def test_extra_env_overrides_what_the_launcher_derives() -> None:
    config = MeshConfig(
        model_dir="/m",
        embedding_model_dir="",
        max_num_seqs=64,
        extra_env=(("MESHSERVE_MAX_NUM_SEQS", "7"), ("MESHSERVE_LOG_LEVEL", "DEBUG")),
    )
    decoder = _env(config, "decoder-0")
    assert decoder["MESHSERVE_MAX_NUM_SEQS"] == "7"
    assert decoder["MESHSERVE_LOG_LEVEL"] == "DEBUG"
    assert _env(config, "gateway")["MESHSERVE_LOG_LEVEL"] == "DEBUG"
    assert decoder["MESHSERVE_PORT"] == str(config.decoder_base_port)


def test_scheduler_replicas_take_consecutive_ports_and_every_client_gets_all_of_them() -> None:
    config = MeshConfig(model_dir="/m", embedding_model_dir="/e", num_decoders=2, num_schedulers=3)
    specs = service_specs(config, "redis://127.0.0.1:6379/0")
    schedulers = [s for s in specs if s.module == "scheduler_svc"]
    assert [s.name for s in schedulers] == ["scheduler", "scheduler-1", "scheduler-2"]
    assert [s.port for s in schedulers] == [50052, 50053, 50054]
    assert all(s.env["MESHSERVE_REDIS_URL"] == "redis://127.0.0.1:6379/0" for s in schedulers)
    expected = "127.0.0.1:50052,127.0.0.1:50053,127.0.0.1:50054"
    clients = [s for s in specs if s.module in ("gateway", "worker_svc")]
    assert {s.name for s in clients} == {"gateway", "decoder-0", "decoder-1", "embedding-0"}
    assert all(s.env["MESHSERVE_SCHEDULER_ADDRESS"] == expected for s in clients)


def test_one_scheduler_by_default() -> None:
    specs = service_specs(MeshConfig(model_dir="/m", embedding_model_dir=""), "")
    assert [s.name for s in specs if s.module == "scheduler_svc"] == ["scheduler"]
    assert (
        _env(MeshConfig(model_dir="/m", embedding_model_dir=""), "gateway")["MESHSERVE_SCHEDULER_ADDRESS"]
        == "127.0.0.1:50052"
    )


def test_gateway_replicas_share_one_port() -> None:
    config = MeshConfig(model_dir="/m", embedding_model_dir="", num_gateways=3)
    gateways = [s for s in service_specs(config, "redis://r") if s.module == "gateway"]
    assert [s.name for s in gateways] == ["gateway", "gateway-1", "gateway-2"]
    assert {s.port for s in gateways} == {config.gateway_port}
    assert all(s.reuse_port and s.env["MESHSERVE_REUSE_PORT"] == "true" for s in gateways)
    assert (
        _env(MeshConfig(model_dir="/m", embedding_model_dir=""), "gateway")["MESHSERVE_REUSE_PORT"] == "false"
    )
    with pytest.raises(ValueError, match="num_gateways"):
        MeshConfig(model_dir="/m", num_gateways=0)


def test_only_starts_the_named_components() -> None:
    config = MeshConfig(
        model_dir="/m", embedding_model_dir="/e", num_schedulers=2, only="scheduler, tokenizer"
    )
    assert [s.name for s in service_specs(config, "")] == ["scheduler", "scheduler-1", "tokenizer"]
    with pytest.raises(ValueError, match="unknown component"):
        MeshConfig(model_dir="/m", only="schedulr")


def test_replicas_running_into_another_port_are_rejected() -> None:
    # scheduler-9 would take 50061, decoder-0's port.
    config = MeshConfig(model_dir="/m", embedding_model_dir="", num_schedulers=10)
    with pytest.raises(ValueError, match="port 50061"):
        service_specs(config, "")
    with pytest.raises(ValueError, match="num_schedulers"):
        MeshConfig(model_dir="/m", num_schedulers=0)


@pytest.mark.parametrize(
    "flags",
    [["--num-schedulers", "0"], ["--num-schedulers", "10"], ["--only", "nope"], ["--restart-backoff-s", "0"]],
)
def test_bad_options_are_usage_errors(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(["up", "--model-dir", "/m", "--embedding-model-dir", "none", *flags])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_supervision_options_reach_the_policy() -> None:
    base = ["up", "--model-dir", "/m", "--embedding-model-dir", "none", "--num-schedulers", "2"]
    restarts = ["--restart-backoff-s", "0.25", "--restart-backoff-max-s", "4", "--restart-reset-s", "60"]
    config = _parse([*base, *restarts])
    assert config.num_schedulers == 2
    assert config.backoff == BackoffPolicy(initial_s=0.25, max_s=4.0, reset_after_s=60.0)


def _placed(config: MeshConfig, monkeypatch: pytest.MonkeyPatch, cpus_: int) -> dict[str, ServiceSpec]:
    """The specs as the launcher places them on a machine whose launcher may use `cpus_` CPUs."""
    monkeypatch.setattr(cpus, "affinity", lambda: list(range(cpus_)))
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    monkeypatch.delenv("MESHSERVE_NUM_THREADS", raising=False)
    monkeypatch.delenv("MESHSERVE_CPU_AFFINITY", raising=False)
    return {s.name: s for s in service_specs(config, "")}


def test_engines_are_started_on_cpus_of_their_own_with_a_thread_per_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = MeshConfig(model_dir="/m", embedding_model_dir="/e", num_decoders=2, num_prefill=1)
    specs = _placed(config, monkeypatch, 13)
    assert {
        n: cpus.format_cpus(specs[n].cpus) for n in ("decoder-0", "decoder-1", "prefill-0", "embedding-0")
    } == {
        "decoder-0": "0-3",
        "decoder-1": "4-7",
        "prefill-0": "8-11",
        "embedding-0": "12",
    }
    assert [specs[n].env["MESHSERVE_NUM_THREADS"] for n in ("decoder-0", "prefill-0", "embedding-0")] == [
        "4",
        "4",
        "1",
    ]
    assert not specs["gateway"].cpus and "MESHSERVE_NUM_THREADS" not in specs["gateway"].env


def test_the_users_threads_and_affinity_win(monkeypatch: pytest.MonkeyPatch) -> None:
    config = MeshConfig(
        model_dir="/m", embedding_model_dir="", num_decoders=2, extra_env=(("MESHSERVE_NUM_THREADS", "3"),)
    )
    specs = _placed(config, monkeypatch, 8)
    assert specs["decoder-1"].env["MESHSERVE_NUM_THREADS"] == "3"
    assert cpus.format_cpus(specs["decoder-1"].cpus) == "4-7"
    config = MeshConfig(
        model_dir="/m", embedding_model_dir="", num_decoders=2, extra_env=(("MESHSERVE_CPU_AFFINITY", "0"),)
    )
    specs = _placed(config, monkeypatch, 8)
    assert not specs["decoder-0"].cpus and "MESHSERVE_NUM_THREADS" not in specs["decoder-0"].env
