"""https from the config (configs/tls.yaml, docs/operations.md "HTTPS"): Ray Serve's proxy serves TLS
when the config's http_options name a key and a certificate. Served: a self-signed certificate made
now, a Ray and Serve of this module's own started with the example's http_options (the key and
certificate swapped for the ones made, a free port), and /infer_token and /v1/chat/completions
answered over https to a client that verifies the server against that certificate. Model-free
first: the example is a valid Serve config, Ray refuses half a pair, the app's args refuse TLS fields."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
import ssl

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
import httpx
import pydantic
import pytest
import yaml

from deployments.app import colocated_app
from deployments.config import AppArgs
from tests.serving import free_port, stop_shared_session

EXAMPLE = Path(__file__).resolve().parent.parent / "configs" / "tls.yaml"
pytestmark = pytest.mark.own_ray  # a Ray of its own, its proxy on TLS

HOST = "127.0.0.1"


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 and localhost, valid for a day: (key.pem, cert.pem)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address(HOST))]), False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                   .sign(key, hashes.SHA256()))
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def example_config() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_the_example_is_a_serve_config_naming_a_key_and_a_certificate():
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(example_config())
    assert config.http_options.ssl_keyfile and config.http_options.ssl_certfile
    half = {**example_config(), "http_options": {**example_config()["http_options"], "ssl_certfile": None}}
    with pytest.raises(pydantic.ValidationError, match="ssl_keyfile"):  # Ray's own check: both or neither
        ServeDeploySchema.model_validate(half)


def test_tls_among_an_apps_args_is_refused_naming_where_it_goes():
    with pytest.raises(pydantic.ValidationError) as refused:
        AppArgs.model_validate({"model": "tiny-llama", "ssl_certfile": "/etc/cert.pem"})
    assert "ssl_certfile" in str(refused.value) and "http_options" in str(refused.value)


@pytest.fixture(scope="module")
def https(tmp_path_factory):
    """(base URL, certificate) of a colocated tiny-llama app behind a proxy started with the example's
    http_options, on a Ray of this module's own (the suite's shared one serves plain HTTP)."""
    import ray
    from ray import serve

    key, cert = self_signed(tmp_path_factory.mktemp("tls"))
    port = free_port()
    options = {**example_config()["http_options"], "host": HOST, "port": port, "ssl_keyfile": str(key),
               "ssl_certfile": str(cert)}
    stop_shared_session()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)  # tests/serving.py says why
    try:
        serve.start(http_options=options)
        serve.run(colocated_app({"torch_threads": 1, "max_iter_times": 16, "embeddings": False}), name="tls",
                  route_prefix="/")
        yield f"https://{HOST}:{port}", cert
    finally:
        serve.shutdown()
        ray.shutdown()


def test_infer_token_and_chat_over_https_verified_against_the_certificate(https):
    url, cert = https
    verified = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(verify=verified, timeout=120) as client:
        infer = client.post(f"{url}/infer_token",
                            json={"input_id": [1, 5, 9], "parameters": {"max_new_tokens": 4, "details": True}})
        assert infer.status_code == 200, infer.text
        assert isinstance(infer.json()["generated_text"], str) and 0 < infer.json()["details"]["generated_tokens"] <= 4
        chat = client.post(f"{url}/v1/chat/completions", json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        assert chat.json()["object"] == "chat.completion" and 0 < chat.json()["usage"]["completion_tokens"] <= 4
    # The verification is real: a client that trusts only the system's authorities refuses the server,
    # and the port speaks no plain HTTP.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/health", timeout=30)
    with pytest.raises(httpx.TransportError):
        httpx.get(url.replace("https://", "http://") + "/health", timeout=30)
