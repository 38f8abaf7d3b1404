"""Entry points that serving frameworks call at start-up, kept out of the
``nixl_keepalive`` package on purpose: a framework loads every plugin
installed, in every one of its processes, and importing ``nixl_keepalive``
is not free (it installs the endpoint-close shim NIXL's UCX plugin binds to).
Here nothing is imported until the operator turns the plugin on.

- ``sglang``: SGLang's general plugin (entry-point group
  ``sglang.srt.plugins``, run by ``load_plugins()`` in SGLang's main
  process and at the start of every scheduler process, before its NIXL
  manager and agent exist). ``NIXL_KEEPALIVE_SGLANG=1`` makes SGLang build
  ``nixl_keepalive.sglang.KeepaliveNixlKVManager`` for its NIXL backend;
  ``0`` or unset leaves SGLang as it is.
"""

from __future__ import annotations

import os

SGLANG_SWITCH = "NIXL_KEEPALIVE_SGLANG"
"""The switch of the SGLang plugin: ``1`` on, ``0`` or unset off."""


def sglang() -> None:
    """SGLang's plugin hook. A value other than ``0``/``1``, or, while the
    switch is on, an SGLang this package does not support or a refused
    ``NIXL_KEEPALIVE_*`` knob, stops the process
    (``SystemExit``: SGLang's plugin loader logs and goes on past an
    ordinary exception, which would start the server without the keepalive
    its operator asked for)."""
    value = os.environ.get(SGLANG_SWITCH, "").strip()
    if value in ("", "0"):
        return
    if value != "1":
        raise SystemExit(
            f"nixl_keepalive: {SGLANG_SWITCH}={value!r} is not accepted: 1 (the keepalive in "
            "SGLang's NIXL manager) or 0 / unset (SGLang's own manager)"
        )
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
