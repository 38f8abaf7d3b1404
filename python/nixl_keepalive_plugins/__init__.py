"""Entry points that serving frameworks call at start-up, kept out of the
``nixl_keepalive`` package on purpose: a framework loads every plugin
installed, in every one of its processes, and importing ``nixl_keepalive``
is not free (it installs the endpoint-close shim NIXL's UCX plugin binds to).
Here nothing is imported until the operator turns the plugin on.

- ``vllm``: vLLM's general plugin (entry-point group
  ``vllm.general_plugins``, run by vLLM in every process it starts, before
  any KV connector is built). ``NIXL_KEEPALIVE_VLLM=1`` makes the name
  launchers write, ``"kv_connector": "NixlConnector"`` (pull mode, vLLM's
  default), build ``nixl_keepalive.vllm.KeepaliveNixlConnector``, and
  vLLM's push-mode name, ``"NixlPushConnector"`` (on vLLM 0.34 also
  ``"NixlConnector"`` with ``"transfer_mode": "push"``, which vLLM's
  factory resolves to that name), build
  ``nixl_keepalive.vllm_push.KeepaliveNixlPushConnector``; ``0`` or unset
  leaves vLLM as it is.
- ``sglang``: SGLang's general plugin (entry-point group
  ``sglang.srt.plugins``, run by ``load_plugins()`` in SGLang's main
  process and at the start of every scheduler process, before its NIXL
  manager and agent exist). ``NIXL_KEEPALIVE_SGLANG=1`` makes SGLang build
  ``nixl_keepalive.sglang.KeepaliveNixlKVManager`` for its NIXL backend;
  ``0`` or unset leaves SGLang as it is.
"""

from __future__ import annotations

import os
from typing import Any, Callable

VLLM_SWITCH = "NIXL_KEEPALIVE_VLLM"
"""The switch of the vLLM plugin: ``1`` on, ``0`` or unset off."""

#: vLLM's connector-factory names that mean the pull-mode NIXL connector:
#: ``NixlConnector`` itself (vLLM 0.33 registers it as the pull class; 0.34
#: resolves it through ``kv_connector_extra_config["transfer_mode"]``,
#: default ``pull``, to the ``NixlPullConnector`` entry) and
#: ``NixlPullConnector``.
VLLM_PULL_NAMES = ("NixlConnector", "NixlPullConnector")

#: vLLM's connector-factory name of the push-mode NIXL connector (vLLM 0.34
#: resolves ``NixlConnector`` with ``transfer_mode: push`` to it).
VLLM_PUSH_NAME = "NixlPushConnector"

SGLANG_SWITCH = "NIXL_KEEPALIVE_SGLANG"
"""The switch of the SGLang plugin: ``1`` on, ``0`` or unset off."""


def _switch(name: str, what: str) -> bool:
    value = os.environ.get(name, "").strip()
    if value in ("", "0"):
        return False
    if value != "1":
        raise SystemExit(f"nixl_keepalive: {name}={value!r} is not accepted: 1 ({what}) or 0 / unset (off)")
    return True


def sglang() -> None:
    """SGLang's plugin hook. A value other than ``0``/``1``, or, while the
    switch is on, an SGLang this package does not support or a refused
    ``NIXL_KEEPALIVE_*`` knob, stops the process
    (``SystemExit``: SGLang's plugin loader logs and goes on past an
    ordinary exception, which would start the server without the keepalive
    its operator asked for)."""
    if not _switch(SGLANG_SWITCH, "the keepalive in SGLang's NIXL manager"):
        return
    try:
        # nixl_keepalive first: its endpoint-close shim must be in place
        # before the process's first nixl_agent (SGLang makes it later).
        import nixl_keepalive  # noqa: F401
        from nixl_keepalive import sglang as keepalive_sglang

        keepalive_sglang.install()
        # The knobs (NIXL_KEEPALIVE_*) checked now, in SGLang's main process
        # before it starts anything, not when the first manager is built.
        nixl_keepalive.Config()
    except Exception as e:
        raise SystemExit(f"nixl_keepalive: {SGLANG_SWITCH}=1, but the SGLang plugin cannot start: {e}") from e


def _keepalive_connector() -> Any:
    # Imported when vLLM builds the connector, as vLLM's own lazy loaders
    # do (the import of vLLM's NIXL connector takes seconds).
    from nixl_keepalive.vllm import KeepaliveNixlConnector

    return KeepaliveNixlConnector


def _keepalive_push_connector() -> Any:
    # As _keepalive_connector, for push mode.
    from nixl_keepalive.vllm_push import KeepaliveNixlPushConnector

    return KeepaliveNixlPushConnector


def _ours(loader: Callable[[], Any]) -> bool:
    return getattr(loader, "__module__", None) == __name__


def vllm() -> None:
    """vLLM's plugin hook. With the switch on, vLLM's connector factory
    builds the keepalive connector for the pull-mode NIXL names
    (:data:`VLLM_PULL_NAMES`) and the push-mode keepalive connector for
    :data:`VLLM_PUSH_NAME`. A value other than ``0``/``1``, a vLLM whose factory lacks
    those names, or a refused ``NIXL_KEEPALIVE_*`` knob stops the process
    (``SystemExit``). Safe to call again (vLLM loads plugins once per
    process; tests may call it more)."""
    if not _switch(VLLM_SWITCH, "the keepalive in vLLM's NIXL connectors, pull and push"):
        return
    try:
        # nixl_keepalive first: its endpoint-close shim must be in place
        # before the process's first nixl_agent (vLLM makes it later).
        import nixl_keepalive
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        registry = getattr(KVConnectorFactory, "_registry", None)
        if not isinstance(registry, dict):
            raise RuntimeError("vLLM's KVConnectorFactory has no _registry of connector loaders")
        missing = [n for n in VLLM_PULL_NAMES + (VLLM_PUSH_NAME,) if n not in registry]
        if missing:
            raise RuntimeError(f"vLLM's connector factory does not register {', '.join(missing)}")
        for name in VLLM_PULL_NAMES:
            registry[name] = _keepalive_connector
        registry[VLLM_PUSH_NAME] = _keepalive_push_connector
        # The knobs (NIXL_KEEPALIVE_*) checked now, before vLLM starts
        # anything, not when the first worker is built.
        nixl_keepalive.Config()
    except Exception as e:
        raise SystemExit(f"nixl_keepalive: {VLLM_SWITCH}=1, but the vLLM plugin cannot start: {e}") from e
