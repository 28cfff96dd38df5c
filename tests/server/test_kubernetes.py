"""``deploy/kubernetes.yaml``, the fleet's Kubernetes example, without a cluster: every manifest valid against
Kubernetes' own schemas (``kubernetes-validate``'s strict ones: an unknown or misspelt field fails), the pod's wiring
consistent (labels, the Secret it reads, the port its probes and the Service name, the command the repository's
image runs), and the pod's command run here with the Secret's variables pointing at a real PostgreSQL and S3 server,
behind an API key, probed as the kubelet probes it (no key) and serving a job whose record and video land in those
stores."""

from __future__ import annotations

import boto3
import httpx
import kubernetes_validate
import psycopg
import pytest
import tomllib
import yaml

from server.cli.command import build_parser
from tests.services import S3_ENV

from .conftest import REPO, ServerProcess, tiny

MANIFEST = REPO / "deploy" / "kubernetes.yaml"
OLDEST_KUBERNETES = "1.30.0"
"""The oldest Kubernetes the example claims (its fields all exist there): the oldest release still patched when the
example was written."""


def _manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def _container() -> dict:
    return _manifests()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_every_manifest_is_valid_kubernetes(version):
    kinds = []
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Deployment", "Secret", "Service"]


def test_the_pod_is_wired_to_its_secret_its_port_and_the_image():
    m = _manifests()
    deployment, service, secret = m["Deployment"], m["Service"], m["Secret"]
    template, container = deployment["spec"]["template"], _container()
    labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels and service["spec"]["selector"] == labels
    assert [e["secretRef"]["name"] for e in container["envFrom"]] == [secret["metadata"]["name"]]
    assert {"CP_INFER_JOB_STORE", "CP_INFER_OUTPUT_STORE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= \
        set(secret["stringData"])
    # The command: the console script the image installs (the Dockerfile has no ENTRYPOINT, so args alone would be
    # run as a program named "serve"), and arguments that cp-infer's own parser takes.
    assert container["command"] == ["cp-infer"]
    assert "cp-infer" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "ENTRYPOINT" not in (REPO / "Dockerfile").read_text()
    args = container["args"]
    parsed = build_parser(args).parse_args(args)
    assert parsed.command == "serve" and parsed.host == "0.0.0.0"
    assert parsed.nproc == container["resources"]["limits"]["nvidia.com/gpu"]
    # One port: the server's, the probes' (by name) and the Service's target.
    port = container["ports"][0]
    assert port["containerPort"] == parsed.port
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == port["name"], probe
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    mounts = {v["mountPath"]: v["name"] for v in container["volumeMounts"]}
    assert mounts["/dev/shm"] in {v["name"] for v in template["spec"]["volumes"] if "emptyDir" in v}
    assert str(parsed.data_dir) in mounts and "/models" in mounts and parsed.model.startswith("/models/")


@pytest.mark.timeout(240)
def test_the_pods_command_serves_on_the_secrets_stores_and_answers_its_probes(tmp_path, cache_dir, pg_url, s3_server):
    """The container's arguments, but one rank, the embedded model (no /models here), this test's folder and a free
    port; its environment the Secret's names with this test's stores. The server asks for an API key; the probes
    send none."""
    secret = _manifests()["Secret"]["stringData"]
    prefix = f"k8s-{tmp_path.name[-12:]}"
    stores = {"CP_INFER_JOB_STORE": pg_url, "CP_INFER_OUTPUT_STORE": f"s3://cp-infer-test/{prefix}",
              **S3_ENV, "AWS_ENDPOINT_URL": s3_server}
    assert set(stores) == set(secret), "the Secret's variables are the ones this run sets"
    args = list(_container()["args"])
    for flag in ("--nproc", "--port", "--data-dir", "--model"):  # the ones ServerProcess sets, and the model's folder
        i = args.index(flag)
        del args[i:i + 2]
    assert args[0] == "serve"
    with pytest.MonkeyPatch.context() as env:
        for name, value in stores.items():
            env.setenv(name, value)
        server = ServerProcess(tmp_path, cache_dir, extra_args=args[1:], nproc=1)
    try:
        server.wait_ready()
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            path = _container()[probe]["httpGet"]["path"]
            assert httpx.get(server.url + path, timeout=30).status_code == 200, probe  # no key, as the kubelet
        assert httpx.get(server.url + "/v1/videos", timeout=30).status_code == 401
        job = server.client.post("/v1/videos", json=tiny()).json()
        assert server.wait_job(job["id"])["status"] == "completed"
        with psycopg.connect(pg_url) as conn:
            assert conn.execute("SELECT status FROM jobs WHERE id = %s", (job["id"],)).fetchone() == ("completed",)
        s3 = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name=S3_ENV["AWS_REGION"])
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="cp-infer-test", Prefix=f"{prefix}/{job['id']}/")
                .get("Contents", [])]
        assert any(k.endswith(".mp4") for k in keys), keys
    finally:
        server.stop()
