"""`flowbroker serve` with a [tls] section it cannot use stops with one line naming the key or the port,
not a traceback (the certificate is loaded, and the TLS port bound, only once the broker runs)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import trustme

FLOWBROKER = shutil.which("flowbroker") or str(Path(sys.executable).with_name("flowbroker"))


def _serve(tmp_path: Path, tls: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "broker.toml"
    config.write_text(f"[tls]\nenabled = true\n{tls}\n")
    return subprocess.run([FLOWBROKER, "serve", "--config", str(config), "--port", "0", "--admin-port", "0",
                           "--no-udp"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "HOME": str(tmp_path)})


def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    cert = trustme.CA().issue_cert("localhost")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    return cert_file, key_file


def test_a_certificate_file_that_cannot_be_loaded_is_a_configuration_error(tmp_path: Path) -> None:
    _, key_file = _certificate(tmp_path)
    result = _serve(tmp_path, f'port = 0\ncert_file = "{tmp_path}/missing.pem"\nkey_file = "{key_file}"')
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "configuration error: [tls] cert_file" in result.stderr and "missing.pem" in result.stderr


def test_a_tls_port_in_use_names_the_tls_port(tmp_path: Path) -> None:
    cert_file, key_file = _certificate(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _serve(tmp_path, f'port = {port}\ncert_file = "{cert_file}"\nkey_file = "{key_file}"')
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"[tls] cannot listen on 127.0.0.1:{port}" in result.stderr
