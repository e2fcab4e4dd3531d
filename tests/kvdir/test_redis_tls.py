"""The KV directory over rediss:// with a password: certificate checked against the CA in
the URL, wrong CA refused (logged, routing falls back to load), nothing raised.

The bundled valkey-server is built without TLS, so a small TLS terminator in front of it
stands in for a TLS Redis; what is under test is our client side (redis-py SSL through
`make_directory`), not Redis's TLS.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading

import pytest

from cluster.engine.scheduling.hashing import block_hashes, model_seed
from cluster.kvdir import make_directory
from cluster.kvdir.embedded import start_local_server

H = block_hashes(list(range(16 * 4)), 16, model_seed("tls-model"))
SLOW_OK = dict(connect_timeout_s=5.0, op_timeout_s=5.0, retry_s=0.1)  # a loaded CI box is slow at handshakes


def self_signed(directory) -> tuple[str, str]:
    """A throwaway CA-flagged certificate for localhost/127.0.0.1 and its key (PEM paths)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


class TlsTerminator:
    """Accepts TLS on a free port and pipes bytes to a plaintext port."""

    def __init__(self, target_port: int, cert: str, key: str):
        self.target, self.ctx = target_port, ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.loop, ready = asyncio.new_event_loop(), threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0, ssl=self.ctx))
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _conn(self, reader, writer) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer), return_exceptions=True)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def tls_redis(tmp_path):
    plain_url, stop = start_local_server(password="s3cret")
    cert, key = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca, _ = self_signed(tmp_path / "other")
    term = TlsTerminator(int(plain_url.rsplit(":", 1)[1].split("/")[0]), cert, key)
    yield term.port, cert, other_ca
    term.close()
    stop()


def test_rediss_with_password_and_ca(tls_redis, monkeypatch):
    port, ca, wrong_ca = tls_redis
    base = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs="

    async def main():
        monkeypatch.setenv("REDIS_PASSWORD", "s3cret")  # the way to keep it out of the URL
        good = make_directory(base + ca, "c", "m", 5.0, **SLOW_OK)
        await good.publish("r", H, [])
        assert await good.overlap(H) == {"r": 4} and good.available
        for bad_url in (base + wrong_ca,                       # a server we cannot verify
                        f"redis://127.0.0.1:{port}/0"):         # plaintext to a TLS port
            bad = make_directory(bad_url, "c", "m", 5.0, **SLOW_OK)
            assert await bad.overlap(H) == {} and not bad.available  # logged, not raised
            await bad.close()
        monkeypatch.setenv("REDIS_PASSWORD", "wrong")
        unauth = make_directory(base + ca, "c", "m", 5.0, **SLOW_OK)
        assert await unauth.overlap(H) == {} and not unauth.available
        for d in (good, unauth):
            await d.close()

    asyncio.run(main())
