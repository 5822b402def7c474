"""Running real agents in tests: TLS material for the server, agent processes, cleanup."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shepherd.agent import wire
from shepherd.agent_bundle import agent_sources, agent_zipapp, build_zipapp
from shepherd.localfleet import agent_pid
from shepherd.proto import agent as bp


@dataclass(frozen=True)
class TLSFiles:
    """A CA and a server certificate for 127.0.0.1 signed by it."""

    ca_der: bytes
    certfile: Path
    keyfile: Path


def make_tls(directory: Path) -> TLSFiles:
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test agent-callback CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.der").write_bytes(ca.public_bytes(serialization.Encoding.DER))
    certfile, keyfile = directory / "server.pem", directory / "server.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return TLSFiles(ca.public_bytes(serialization.Encoding.DER), certfile, keyfile)


def host_macs() -> set[bytes]:
    """MACs of this machine's interfaces with a device (what the agent reports)."""
    return {
        bytes.fromhex((p / "address").read_text().strip().replace(":", ""))
        for p in Path("/sys/class/net").iterdir()
        if (p / "device").exists()
    }


def patched_agent(module: str, old: bytes, new: bytes) -> bytes:
    """The real agent's zipapp with ``old`` replaced by ``new`` in its ``module``
    (a file name in ``shepherd/agent``): the real agent with a bug injected."""
    sources = agent_sources()
    name = f"shepherd/agent/{module}"
    assert old in sources[name], (name, old)
    return build_zipapp({**sources, name: sources[name].replace(old, new)})


def kill_agent(target: Path) -> None:
    """SIGKILL the detached agent installed at ``target``, if any (test cleanup)."""
    pid = agent_pid(target)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


def start_agent_process(
    target: Path,
    machine_id: str,
    endpoint: str,
    *,
    interval: float,
    cap: float,
    ca: bytes = b"",
    zipapp: bytes | None = None,
) -> bytes:
    """Install the agent (``zipapp``, the real one by default) at ``target``
    and run it as the initializer would, without SSH; return its public
    key. The agent detaches and heartbeats."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(agent_zipapp() if zipapp is None else zipapp)
    target.chmod(0o755)
    init = wire.TakeoverInit(machine_id, endpoint, ca)
    done = subprocess.run(
        [
            "/usr/bin/python3",
            "-I",
            "-S",
            str(target),
            "--heartbeat-interval",
            f"{interval:g}",
            "--heartbeat-backoff-cap",
            f"{cap:g}",
        ],
        input=init.encode(),
        capture_output=True,
        check=True,
        timeout=60,
    )
    response = bp.TakeoverResponse.parse(done.stdout)
    assert response.success is not None, (response, done.stderr)
    return response.success.key
