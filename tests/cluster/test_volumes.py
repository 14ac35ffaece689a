"""A pod's volumes as local folders (kvfleet/cluster/volumes.py), from an in-memory API."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cluster.podspec import ConfigError
from kvfleet.cluster.volumes import TokenSource, materialise

from .fake_api import FakeApi, secret

NS = "/api/v1/namespaces/team"


def a_pod(*volumes: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": "web-1", "namespace": "team", "uid": "u-1", "labels": {"app": "web"}}
    return {
        "metadata": meta,
        "spec": {"serviceAccountName": "robot", "volumes": list(volumes)},
        "status": {"podIP": "127.1.0.2"},
    }


def api() -> FakeApi:
    return FakeApi(
        {
            f"{NS}/configmaps/conf": {
                "data": {"a.yaml": "a: 1\n", "b": "two"},
                "binaryData": {"bin": base64.b64encode(b"\x00\x01").decode()},
            },
            f"{NS}/secrets/creds": secret({"token": "s3cret"}),
            f"{NS}/persistentvolumeclaims/models": {"spec": {"volumeName": "pv-1"}},
            "/api/v1/persistentvolumes/pv-1": {"spec": {"hostPath": {"path": "/srv/models"}}},
            f"{NS}/persistentvolumeclaims/scratch": {"spec": {}},
        }
    )


def test_empty_dir_config_map_secret_and_downward_api_volumes_become_folders_with_their_files(
    tmp_path: Path,
) -> None:
    pod = a_pod(
        {"name": "scratch", "emptyDir": {"medium": "Memory"}},
        {"name": "conf", "configMap": {"name": "conf"}},
        {"name": "one", "configMap": {"name": "conf", "items": [{"key": "b", "path": "sub/b.txt"}]}},
        {"name": "creds", "secret": {"secretName": "creds", "defaultMode": 0o400}},
        {
            "name": "info",
            "downwardAPI": {
                "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels['app']"}}]
            },
        },
    )
    folders = materialise(pod, tmp_path / "pod", tmp_path, api(), None)
    vol = tmp_path / "pod" / "volumes"
    assert folders == {name: str(vol / name) for name in ("scratch", "conf", "one", "creds", "info")}
    assert list((vol / "scratch").iterdir()) == []
    assert (vol / "conf" / "a.yaml").read_text() == "a: 1\n" and (
        vol / "conf" / "bin"
    ).read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in (vol / "one").rglob("*")) == ["b.txt", "sub"]
    assert (vol / "creds" / "token").read_text() == "s3cret" and (
        vol / "creds" / "token"
    ).stat().st_mode & 0o777 == 0o400
    assert (vol / "info" / "labels").read_text() == "web"


def test_a_projected_service_account_volume_holds_a_bound_token_the_ca_and_the_namespace(
    tmp_path: Path,
) -> None:
    fake = api()
    fake.objects[f"{NS}/configmaps/kube-root-ca.crt"] = {"data": {"ca.crt": "CA"}}
    sources = [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]
    pod = a_pod({"name": "kube-api-access-x", "projected": {"sources": sources}})
    materialise(pod, tmp_path / "pod", tmp_path, fake, TokenSource(fake, pod))
    folder = tmp_path / "pod" / "volumes" / "kube-api-access-x"
    assert [(folder / f).read_text() for f in ("token", "ca.crt", "namespace")] == ["token-1", "CA", "team"]
    verb, path, body = fake.writes[0]
    assert (verb, path) == ("POST", f"{NS}/serviceaccounts/robot/token")
    assert body is not None and body["spec"]["boundObjectRef"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "web-1",
        "uid": "u-1",
    }


def test_a_token_is_renewed_once_half_its_life_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, now = api(), [1000.0]
    monkeypatch.setattr("kvfleet.cluster.volumes.time.monotonic", lambda: now[0])
    tokens = TokenSource(fake, a_pod(), seconds=3600)
    assert tokens.token() == tokens.token() == "token-1" and not tokens.due()
    now[0] += 1800
    assert tokens.due() and tokens.token() == "token-2"


def test_claims_map_to_their_host_path_volume_or_to_a_shared_folder_and_host_paths_are_themselves(
    tmp_path: Path,
) -> None:
    pod = a_pod(
        {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
        {"name": "scratch", "persistentVolumeClaim": {"claimName": "scratch"}},
        {"name": "host", "hostPath": {"path": str(tmp_path / "host"), "type": "DirectoryOrCreate"}},
    )
    fake = api()
    fake.objects["/api/v1/persistentvolumes/pv-1"]["spec"]["hostPath"]["path"] = str(tmp_path / "srv")
    folders = materialise(pod, tmp_path / "pod", tmp_path, fake, None)
    assert folders == {
        "models": str(tmp_path / "srv"),
        "scratch": str(tmp_path / "claims" / "team" / "scratch"),
        "host": str(tmp_path / "host"),
    }
    assert (tmp_path / "host").is_dir()


def test_a_missing_config_map_is_a_config_error_unless_optional(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="absent"):
        materialise(
            a_pod({"name": "x", "configMap": {"name": "absent"}}), tmp_path / "pod", tmp_path, api(), None
        )
    assert materialise(
        a_pod({"name": "x", "configMap": {"name": "absent", "optional": True}}),
        tmp_path / "pod",
        tmp_path,
        api(),
        None,
    )
    with pytest.raises(ConfigError, match="leaves"):
        materialise(
            a_pod(
                {"name": "x", "configMap": {"name": "conf", "items": [{"key": "b", "path": "../../escape"}]}}
            ),
            tmp_path / "pod",
            tmp_path,
            api(),
            None,
        )
