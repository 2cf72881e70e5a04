"""The launcher's per-service environment: its own settings, then `extra_env` on top."""

from __future__ import annotations

from services.launcher import MeshConfig, service_specs


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
