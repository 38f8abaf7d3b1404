"""The connector's refusals and knobs, without a prefill."""

from __future__ import annotations

import pytest


def test_other_vllm_versions_are_refused_naming_both(vllm_ready):
    from nixl_keepalive import vllm as kv

    with pytest.raises(RuntimeError) as e:
        kv.check_vllm_version("0.32.1")
    assert "0.32.1" in str(e.value) and "0.33.x" in str(e.value)
    assert kv.check_vllm_version("0.33.0") == "0.33.0"
    assert kv.check_vllm_version("0.33.7") == "0.33.7"
    with pytest.raises(RuntimeError):
        kv.check_vllm_version("0.330.0")


def test_knobs_from_extra_config(vllm_ready):
    import nixl_keepalive
    from nixl_keepalive import vllm as kv

    class Kv:
        kv_connector_extra_config = {"keepalive": {"interval": "1s", "read_timeout": "250ms"}}

    config, own = kv.keepalive_knobs(Kv)
    assert config == {"interval": "1s"} and own == {"read_timeout": 0.25}
    assert nixl_keepalive.Config(**config).as_dict()["interval"] == 1.0
    Kv.kv_connector_extra_config = {"keepalive": {"read_timeout": "soon"}}
    with pytest.raises(ValueError, match="read_timeout"):
        kv.keepalive_knobs(Kv)
    Kv.kv_connector_extra_config = {"keepalive": ["interval"]}
    with pytest.raises(ValueError, match="JSON object"):
        kv.keepalive_knobs(Kv)


def test_bad_knob_refused_when_the_worker_is_built(decode):
    import nixl_keepalive

    with pytest.raises((nixl_keepalive.ConfigError, TypeError)) as e:
        decode(keepalive={"interval": "never"})
    assert "interval" in str(e.value)


def test_agent_made_thread_safe_and_progressed(decode):
    d = decode()
    snap = d.ka.snapshot()
    assert snap["heartbeat_delivery"] == "progress_thread"
    assert d.worker.nixl_wrapper is d.ka.agent


def test_agent_name_parsed_from_nixl_metadata(vllm_ready):
    from nixl._api import nixl_agent

    from nixl_keepalive import vllm as kv

    a = nixl_agent("parse-me-7")
    assert kv.parse_agent_name(a.get_agent_metadata()) == "parse-me-7"
    assert kv.parse_agent_name(b"fake_agent_metadata") is None
