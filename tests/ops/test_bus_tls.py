"""TLS on the bus: nats-server serves the certificate `tokenbus up --tls-cert/--tls-key` names; a client
that does not trust its CA is refused (no plain connection, no other CA), one given the CA connects."""
import asyncio
import ssl

import nats
import orjson
import pytest

import bus as nats_bus
from ops import bus, procs
from schemas.credentials import CA_ENV
from tests.ops.pki import make_pki


@pytest.fixture
def tls_server(tmp_path):
    """nats-server with TLS only (no authorization), its CA: (url, pki)."""
    pki, port = make_pki(tmp_path / "pki"), procs.free_port()
    proc = procs.start_nats(port, tmp_path, tmp_path / "nats.log",
                            config=bus.write_config(tmp_path / "nats.conf", None, bus.Tls(pki.cert, pki.key)))
    yield f"nats://127.0.0.1:{port}", pki
    procs.stop([proc])


async def connects(url: str, **options) -> None:
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0, **options)
    await nc.close()


def test_a_client_without_the_ca_is_refused_and_one_with_it_connects(tls_server, tmp_path, monkeypatch):
    url, pki = tls_server
    other = make_pki(tmp_path / "other", "another")

    async def main():
        with pytest.raises(ssl.SSLCertVerificationError):         # no CA: the system's, which never signed it
            await connects(url)
        with pytest.raises(ssl.SSLCertVerificationError):         # a CA that did not sign it
            await connects(url, tls=ssl.create_default_context(cafile=str(other.ca)))
        monkeypatch.setenv(CA_ENV, str(pki.ca))                  # how `tokenbus up --tls-ca` hands it to services
        nc = await nats_bus.connect(url, "test-tls")
        sub = await nc.subscribe("tb.out.r1")
        await nc.publish("tb.out.r1", b"hi")
        assert (await sub.next_msg(timeout=5)).data == b"hi"
        await nc.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_server_refuses_plain_text(tls_server):
    url, _ = tls_server

    async def main():
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        assert orjson.loads((await reader.readline()).split(b" ", 1)[1])["tls_required"] is True
        writer.write(b"CONNECT {}\r\nPING\r\n")
        answer = await reader.read(200)
        writer.close()
        return answer

    answer = asyncio.run(asyncio.wait_for(main(), 10))
    assert answer == b"", answer                                 # closed: it waited for a TLS handshake
