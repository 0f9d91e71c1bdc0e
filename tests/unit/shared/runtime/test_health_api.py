"""The HTTP API every service serves (shared/runtime/health_api.py), on a live ServiceRuntime in a process of
its own: bearer tokens on every route but /healthz and /openapi.json, /metrics configurable, and
schemathesis against the OpenAPI document it serves (no 5xx, the auth answers the document promises)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support import free_port

TOKEN = "the-services-http-token-0123456789"
METRICS_TOKEN = "the-scrapers-own-token-0123456789"
SERVE = """
import time
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime

runtime = ServiceRuntime("probe", Settings())
while not runtime.stopping:
    time.sleep(0.1)
runtime.close()
"""


@contextmanager
def service(tmp_path: Path, **security: str):
    """A ServiceRuntime with RS_SECURITY__* set from `security`; yields its base URL."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RS_")}, "RS_HEALTH_PORT": str(port),
           **{f"RS_SECURITY__{name.upper()}": value for name, value in security.items()}}
    log_path = tmp_path / f"service-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", SERVE], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{base}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
        for secret in security.values():
            assert secret not in log_path.read_text()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_every_route_but_healthz_and_the_document_asks_for_the_token(tmp_path):
    with service(tmp_path, http_token=TOKEN) as base:
        assert httpx.get(f"{base}/healthz").status_code == 200
        paths = httpx.get(f"{base}/openapi.json").json()["paths"]
        assert paths["/metrics"]["get"]["security"] == [{"bearer": []}]
        for path in ("/metrics", "/metricsx", "/nowhere"):
            missing = httpx.get(f"{base}{path}")
            assert missing.status_code == 401 and missing.headers["WWW-Authenticate"].startswith("Bearer")
            assert httpx.get(f"{base}{path}", headers=bearer("not-" + TOKEN)).status_code == 403
            assert httpx.get(f"{base}{path}", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
        assert httpx.get(f"{base}/metrics", headers=bearer(TOKEN)).status_code == 200
        assert httpx.get(f"{base}/metrics?x=1", headers=bearer(TOKEN)).status_code == 200
        assert httpx.get(f"{base}/nowhere", headers=bearer(TOKEN)).status_code == 404


def test_metrics_can_have_a_token_of_its_own_or_be_open(tmp_path):
    with service(tmp_path, http_token=TOKEN, metrics_token=METRICS_TOKEN) as base:
        assert httpx.get(f"{base}/metrics", headers=bearer(METRICS_TOKEN)).status_code == 200
        assert httpx.get(f"{base}/metrics", headers=bearer(TOKEN)).status_code == 403
        assert httpx.get(f"{base}/nowhere", headers=bearer(METRICS_TOKEN)).status_code == 403
    with service(tmp_path, http_token=TOKEN, metrics_open="true") as base:
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.get(f"{base}/nowhere").status_code == 401
        assert httpx.get(f"{base}/openapi.json").json()["paths"]["/metrics"]["get"]["security"] == []


def test_without_a_token_every_route_is_open_and_other_methods_are_not_allowed(tmp_path):
    with service(tmp_path) as base:
        assert httpx.get(f"{base}/metrics").status_code == 200
        for method in ("POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "BREW"):
            reply = httpx.request(method, f"{base}/healthz")
            assert reply.status_code == 405 and reply.headers["Allow"] == "GET", method


def test_schemathesis_finds_no_server_error_and_the_auth_the_document_promises(tmp_path):
    """Every check schemathesis has, its examples, coverage and fuzzing phases, positive and negative data,
    against the document the service serves; the HAR file of every request it sent is then counted."""
    har = tmp_path / "requests.har"
    with service(tmp_path, http_token=TOKEN) as base:
        run = subprocess.run(
            [str(Path(sys.executable).with_name("schemathesis")), "run", f"{base}/openapi.json",
             "--checks", "all", "--phases", "examples,coverage,fuzzing", "--mode", "all", "--max-examples",
             "200", "--seed", "1", "--header", f"Authorization: Bearer {TOKEN}", "--report", "har",
             "--report-har-path", str(har),
             # the HAR keeps the headers sent
             "--workers", "1", "--warnings", "off", "--output-sanitize", "false"],
            capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)  # its cache goes there
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        entries = json.loads(har.read_text())["log"]["entries"]
        statuses = Counter((e["request"]["method"], e["request"]["url"].removeprefix(base).split("?")[0],
                            e["response"]["status"]) for e in entries)
        print(f"schemathesis: {len(entries)} requests; "
              f"(method, path, status): {dict(sorted(statuses.items()))}")
        assert not [key for key in statuses if key[2] >= 500]

        def auth_of(entry) -> str | None:
            return next((h["value"] for h in entry["request"]["headers"]
                         if h["name"].lower() == "authorization"), None)

        for entry in entries:
            path = entry["request"]["url"].removeprefix(base).split("?")[0]
            if entry["request"]["method"] != "GET" or path != "/metrics":
                continue
            given, status = auth_of(entry), entry["response"]["status"]
            if given is None:
                assert status == 401, entry
            elif given != f"Bearer {TOKEN}":
                assert status in (401, 403), (given, entry)
        # what the generated requests did not happen to cover is asked for directly
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/metrics", headers=bearer("wrong-token-of-some-length")).status_code == 403


def test_any_authorization_header_is_a_401_a_403_or_the_token_itself(tmp_path):
    """The header parsing under fuzzing: whatever a client sends as Authorization, never a server error,
    and nothing but the exact token gets in."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.configuration import set_hypothesis_home_dir

    header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                          max_size=120)
    near_misses = st.sampled_from([TOKEN[:-1], TOKEN + "x", TOKEN.upper(), f" {TOKEN}", f"{TOKEN}\t"])
    statuses: Counter = Counter()
    set_hypothesis_home_dir(tmp_path / "hypothesis")  # its caches, out of the working tree
    with service(tmp_path, http_token=TOKEN) as base, httpx.Client() as client:

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(scheme=st.sampled_from(["Bearer", "bearer", "Basic", "", "Bearer  "]) | header_text,
               credential=near_misses | header_text)
        def probe(scheme: str, credential: str) -> None:
            value = f"{scheme} {credential}".strip()
            reply = client.get(f"{base}/metrics", headers=[(b"Authorization", value.encode("latin-1"))])
            statuses[reply.status_code] += 1
            scheme_given, _, presented = value.partition(" ")
            if scheme_given.lower() == "bearer" and presented.strip() == TOKEN:
                assert reply.status_code == 200
            else:
                assert reply.status_code in (401, 403), (value, reply.status_code)

        try:
            probe()
        finally:
            set_hypothesis_home_dir(None)
    print(f"Authorization fuzzing: {sum(statuses.values())} requests, statuses {dict(statuses)}")
