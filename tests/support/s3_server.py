"""An S3-compatible server on loopback for the shared-log tests: moto in server mode (a real
HTTP server speaking the S3 protocol), one bucket, credentials of its own."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "lifemem-test",
    "AWS_SECRET_ACCESS_KEY": "lifemem-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str  # http://127.0.0.1:PORT
    bucket: str

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def s3_server(monkeypatch_env: dict[str, str] | None = None) -> Iterator[S3Server]:
    """A moto S3 server on 127.0.0.1 with one new bucket; stopped on exit."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"lifemem-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_ENV["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket=bucket)
        yield S3Server(endpoint, bucket)
    finally:
        server.stop()
