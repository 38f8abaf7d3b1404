"""The connector's refusals and knobs, without a prefill."""

from __future__ import annotations

import pytest

# Every scenario here runs on every tested release in CI (conftest.EVERY_RELEASE).
pytestmark = pytest.mark.every_release


def test_an_untested_vllm_runs_with_one_warning_when_every_hook_is_there(vllm_ready, caplog):
    from nixl_keepalive import vllm as kv

    assert kv.check_vllm_version("0.33.0") == "0.33.0"
    assert kv.check_vllm_version("0.34.2") == "0.34.2"
    assert not [r for r in caplog.records if "not a tested release" in r.getMessage()]
    with caplog.at_level("WARNING", logger="nixl_keepalive.vllm"):
        assert kv.check_vllm_version("0.35.0") == "0.35.0"
        assert kv.check_vllm_version("0.35.0") == "0.35.0"
    warned = [r.getMessage() for r in caplog.records if "not a tested release" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "0.35.0" in warned[0] and "0.33.x, 0.34.x" in warned[0]


def test_a_vllm_missing_a_hook_is_refused_naming_it(vllm_ready, monkeypatch):
    from nixl_keepalive import vllm as kv

    # Defined on vLLM's base worker class, inherited by the pull worker.
    monkeypatch.delattr(kv._base_worker.NixlBaseConnectorWorker, "_handle_failed_transfer")
    with pytest.raises(RuntimeError) as e:
        kv.check_vllm_version("0.33.0")
    assert "_handle_failed_transfer is missing" in str(e.value), e.value


def test_a_vllm_whose_scheduler_side_lacks_a_hook_is_refused_naming_it(vllm_ready, monkeypatch):
    from nixl_keepalive import vllm as kv

    # The scheduler side's: defined on vLLM's base scheduler class.
    base = kv.NixlPullConnectorScheduler.__mro__[1]
    monkeypatch.delattr(base, "update_connector_output")
    with pytest.raises(RuntimeError) as e:
        kv.check_vllm_version()
    assert "scheduler update_connector_output is missing" in str(e.value), e.value


def test_a_vllm_hook_with_other_parameters_is_refused_naming_both(vllm_ready, monkeypatch):
    from nixl_keepalive import vllm as kv

    def reshaped(self, req_id, handle, why):  # not what the keepalive calls it with
        raise AssertionError("never called")

    monkeypatch.setattr(kv.NixlPullConnectorWorker, "_handle_failed_transfer", reshaped)
    with pytest.raises(RuntimeError) as e:
        kv.check_vllm_version()
    assert ("takes (req_id, handle, why), not (req_id, handle, failed_req_ids, record_failed_transfer)"
            in str(e.value)), e.value


def test_every_hook_is_there_on_the_installed_vllm(vllm_ready):
    from nixl_keepalive import vllm_hooks
    from nixl_keepalive import vllm as kv

    assert vllm_hooks.problems("worker", kv.NixlPullConnectorWorker) == []
    assert vllm_hooks.problems("base_worker", kv._base_worker) == []
    assert vllm_hooks.problems("connector", kv.NixlBaseConnector) == []
    assert vllm_hooks.problems("scheduler", kv.NixlPullConnectorScheduler) == []


def test_knobs_from_extra_config(vllm_ready):
    import nixl_keepalive
    from nixl_keepalive import vllm as kv

    class Kv:
        kv_connector_extra_config = {"keepalive": {"interval": "1s", "read_timeout": "250ms"}}

    config, own = kv.keepalive_knobs(Kv)
    assert config == {"interval": "1s"}
    assert own == {"read_timeout": 0.25, "control_addr": None, "control_token_file": None}
    assert nixl_keepalive.Config(**config).as_dict()["interval"] == 1.0
    Kv.kv_connector_extra_config = {"keepalive": {"read_timeout": "soon"}}
    with pytest.raises(ValueError, match="read_timeout"):
        kv.keepalive_knobs(Kv)
    Kv.kv_connector_extra_config = {"keepalive": ["interval"]}
    with pytest.raises(ValueError, match="JSON object"):
        kv.keepalive_knobs(Kv)


@pytest.mark.parametrize("extra, said", [
    # A typo of the connector's own knob: named, with the fix.
    ({"keepalive": {"read_timout": "10s"}}, "'read_timout' (did you mean 'read_timeout'?)"),
    ({"keepalive": {"intervall": "1s"}}, "'intervall' (did you mean 'interval'?)"),
    # The Python API's options are not knobs here.
    ({"keepalive": {"seed": 3}}, "unknown knob(s): 'seed'"),
    # A knob at the top level, where vLLM ignores it.
    ({"interval": "1s"}, "at the top level, where vLLM ignores it"),
    # A misspelt container key.
    ({"keep_alive": {"interval": "1s"}}, "is not read by the keepalive"),
    ({"keepAlive": {"interval": "1s"}}, "is not read by the keepalive"),
    ({"nixl_keepalive": {"interval": "1s"}}, "is not read by the keepalive"),
])
def test_knob_mistakes_are_refused_naming_the_fix(vllm_ready, extra, said):
    from nixl_keepalive import vllm as kv

    class Kv:
        kv_connector_extra_config = extra

    with pytest.raises(ValueError) as e:
        kv.keepalive_knobs(Kv)
    assert said in str(e.value), e.value
    if "unknown knob" in said or "top level" in said or "not read" in said:
        assert "read_timeout" in str(e.value) or "keepalive" in str(e.value)


def test_vllms_own_extra_config_keys_pass(vllm_ready):
    from nixl_keepalive import vllm as kv

    class Kv:
        kv_connector_extra_config = {"kv_lease_duration": 30, "transfer_mode": "pull", "backends": ["UCX"],
                                     "keepalive": {"interval": "1s"}}

    assert kv.keepalive_knobs(Kv)[0] == {"interval": "1s"}


def test_the_knob_list_is_the_configs(vllm_ready):
    import nixl_keepalive
    from nixl_keepalive import vllm as kv

    # as_dict also reports the jitter's seed, an option of the Python API.
    assert set(kv._CONFIG_KNOBS) | {"seed"} == set(nixl_keepalive.Config(env=False).as_dict())


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
    # The package's one test of what a nixl_agent is, on vLLM's own NIXL.
    import nixl_keepalive

    from nixl_keepalive import vllm_service

    assert vllm_service._is_nixl_agent is nixl_keepalive._is_nixl_agent and vllm_service._is_nixl_agent(a)
