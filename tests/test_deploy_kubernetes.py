"""deploy/kubernetes: schema-valid, least-privilege, and its generated objects current."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess

import pytest
import yaml

from deploy_helpers import ROOT, crd_validators, load_all

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (pip install -e '.[test]') is not installed")

K8S = ROOT / "deploy" / "kubernetes"
SOCKET_DIR = "/run/syncwatch"


def _generate_module():
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def manifest_files():
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def objects():
    return [(p, o) for p in manifest_files() for o in load_all(p)]


def kustomized_objects():
    """What ``kubectl apply -k deploy/kubernetes`` creates (its kustomization lists plain files)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [o for name in kustomization["resources"] for o in load_all(K8S / name)]


def one(kind: str, objs=None) -> dict:
    found = [o for o in (objs or kustomized_objects()) if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def validate_builtin(obj: dict) -> None:
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def validate_custom(obj: dict) -> None:
    crd_validators()[(obj["apiVersion"], obj["kind"])].validate(obj)


def test_every_manifest_is_schema_valid():
    kinds = set()
    for path, obj in objects():
        kinds.add(obj["kind"])
        try:
            if (obj["apiVersion"], obj["kind"]) in crd_validators():
                validate_custom(obj)
            else:
                validate_builtin(obj)
        except Exception as e:  # name the file: the schema error alone does not
            pytest.fail(f"{path.relative_to(ROOT)}: {obj['kind']}/{obj['metadata']['name']}: {e}")
    assert {"DaemonSet", "Service", "ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap",
            "Job", "Namespace"} <= kinds


def test_schema_checks_reject_mistakes():
    """The validators above are live: a misspelt field fails each kind of check."""
    daemonset = one("DaemonSet")
    daemonset["spec"]["template"]["spec"]["automountServiceAcountToken"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_builtin(daemonset)
    monitor = one("ServiceMonitor")
    monitor["spec"]["sampelLimit"] = 1000
    with pytest.raises(Exception, match="sampelLimit"):
        validate_custom(monitor)
    rule = load_all(K8S / "prometheusrule.yaml")[0]
    rule["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    with pytest.raises(Exception, match="five minutes"):
        validate_custom(rule)


def test_daemonset_is_least_privileged():
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in pod["initContainers"] + pod["containers"]:
        sc = container["securityContext"]
        assert sc["capabilities"]["drop"] == ["ALL"], container["name"]
        assert sc["allowPrivilegeEscalation"] is False, container["name"]
        assert sc["readOnlyRootFilesystem"] is True, container["name"]
        assert not sc.get("privileged"), container["name"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), (container["name"], kind)
        for mount in container["volumeMounts"]:
            host = volumes[mount["name"]].get("hostPath")
            if host and host["path"] != SOCKET_DIR:
                assert mount.get("readOnly") is True, f"{container['name']}: {host['path']} writable"
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert not sc["capabilities"].get("add"), container["name"]
        assert sc.get("runAsNonRoot", True) and sc.get("runAsUser", 1) != 0, container["name"]
    # The init container hands the socket directory to the daemon's user: CHOWN, nothing more.
    for container in pod["initContainers"]:
        assert set(container["securityContext"]["capabilities"].get("add", [])) <= {"CHOWN"}
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"/sys", SOCKET_DIR}


def test_daemonset_tolerates_every_taint():
    """Only nvidia.com/gpu:NoSchedule was tolerated: a GPU pool with another taint (a team's
    dedicated=..., NoExecute) had no daemon, and so no syncwatch series at all."""
    tolerations = one("DaemonSet")["spec"]["template"]["spec"]["tolerations"]
    assert {"operator": "Exists"} in tolerations


def test_namespace_admits_the_daemons_priority_class():
    """GKE admits pods of system-node-critical / system-cluster-critical outside kube-system only
    where a ResourceQuota scoped to that class exists (Kubernetes' "limit priority class
    consumption by default"): without it the DaemonSet created no pod, "insufficient quota to
    match these scopes: [{PriorityClass In [system-node-critical system-cluster-critical]}]"."""
    objs = kustomized_objects()
    daemonset = one("DaemonSet", objs)
    priority = daemonset["spec"]["template"]["spec"]["priorityClassName"]
    quotas = [o["spec"] for o in objs if o["kind"] == "ResourceQuota"
              and o["metadata"]["namespace"] == daemonset["metadata"]["namespace"]]
    admitting = [q for q in quotas for e in q["scopeSelector"]["matchExpressions"]
                 if e["scopeName"] == "PriorityClass" and e["operator"] == "In" and priority in e["values"]]
    assert admitting, f"no ResourceQuota admits {priority} pods"
    for quota in admitting:  # bounds no real cluster's node count, and nothing else
        assert set(quota["hard"]) == {"pods"} and quota["hard"]["pods"] in ("1G", 1_000_000_000)


def test_socket_dir_init_container_works_on_every_pod_start(tmp_path):
    """The init container's command, run as it runs in the pod (uid 0 with CHOWN alone), on the
    directory kubelet creates and again on the one the previous pod left (a rollout, a restart)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to run with CHOWN as the only capability")
    init = one("DaemonSet")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"]["add"] == ["CHOWN"]
    directory = tmp_path / "run-syncwatch"
    directory.mkdir(mode=0o755)  # what kubelet's DirectoryOrCreate makes: root:root 0755
    command = [arg.replace(SOCKET_DIR, str(directory)) for arg in init["command"]]
    for start in ("first pod", "next pod"):
        r = subprocess.run(["setpriv", "--bounding-set=-all,+chown", "--inh-caps=-all", "--", *command],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{start}: {r.stderr}"
        st = directory.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (65532, 65532, 0o750), start


def test_daemonset_port_probes_and_scrape_limits():
    objs = kustomized_objects()
    daemon = one("DaemonSet", objs)["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in daemon["ports"]] == ["metrics"]
    assert "--listen=0.0.0.0:%d" % daemon["ports"][0]["containerPort"] in daemon["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert daemon[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert one("Service", objs)["spec"]["ports"][0]["targetPort"] == "metrics"
    monitors = [one("ServiceMonitor", objs)] + [o for p, o in objects() if o["kind"] == "PodMonitor"]
    for monitor in monitors:
        spec = monitor["spec"]
        endpoints = spec.get("endpoints") or spec["podMetricsEndpoints"]
        assert [e["port"] for e in endpoints] == ["metrics"]
        assert spec["sampleLimit"] > 0 and spec["labelLimit"] > 0


def _operator_job_label(monitor: dict, objs) -> str:
    """The ``job`` label Prometheus Operator gives a monitor's targets, as its CRDs document
    ``jobLabel``: the named label of the Service (ServiceMonitor) or Pod (PodMonitor), else the
    Service's name, or ``<namespace>/<name>`` of the PodMonitor."""
    key = monitor["spec"].get("jobLabel")
    if monitor["kind"] == "ServiceMonitor":
        service = one("Service", objs)
        return service["metadata"].get("labels", {}).get(key) or service["metadata"]["name"]
    pod_labels = one("DaemonSet", objs)["spec"]["template"]["metadata"]["labels"]
    if key:
        return pod_labels[key]
    return f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"


def test_monitors_give_the_job_label_the_daemon_down_alert_selects():
    from syncwatch.rules.thresholds import THRESHOLDS
    objs = kustomized_objects()
    monitors = [one("ServiceMonitor", objs)] + [o for p, o in objects() if o["kind"] == "PodMonitor"]
    assert len(monitors) == 2
    for monitor in monitors:
        assert _operator_job_label(monitor, objs) == THRESHOLDS.scrape_job, monitor["kind"]


def test_training_job_uses_the_daemon_socket():
    daemonset = one("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    daemon = pod["containers"][0]
    socket_arg = next(a for a in daemon["args"] if a.startswith("--socket="))
    job = one("Job", load_all(K8S / "examples" / "training-job.yaml"))
    train_pod = job["spec"]["template"]["spec"]
    train = train_pod["containers"][0]
    env = {e["name"]: e for e in train["env"]}
    assert "--socket=" + env["SYNCWATCH_SOCKET"]["value"] == socket_arg
    assert "job-name" in env["SYNCWATCH_JOB"]["valueFrom"]["fieldRef"]["fieldPath"]
    volume = next(v for v in train_pod["volumes"] if v.get("hostPath", {}).get("path") == SOCKET_DIR)
    mount = next(m for m in train["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == SOCKET_DIR and mount["readOnly"] is True
    # Monitoring never keeps training from starting: a node without the directory (no daemon
    # there yet) must not fail the pod's hostPath check.
    assert volume["hostPath"].get("type", "") in ("", "DirectoryOrCreate")
    # 0750 directory, 0660 socket, both the daemon's group: the job must be in it.
    assert pod["securityContext"]["runAsGroup"] in train_pod["securityContext"]["supplementalGroups"]


def test_training_job_labels_its_ranks_with_the_node_they_run_on(monkeypatch):
    """A rank's node label comes from its own environment (SYNCWATCH_NODE, NODE_NAME, else the
    host name), never from the daemon. In a pod the host name is the pod's name, so without
    NODE_NAME from the downward API the alerts named pods ("Rank 3 on node resnet-ddp-0-x7k2p")
    where an operator needs a node to drain, and two pods of a job on one node gave one daemon
    (one ``instance``) two node values, which the hardware dashboard's join by instance refuses."""
    from syncwatch.instrument.identity import node_from_env
    job = one("Job", load_all(K8S / "examples" / "training-job.yaml"))
    train = job["spec"]["template"]["spec"]["containers"][0]
    downward = {"spec.nodeName": "gpu-node-17",
                "metadata.labels['batch.kubernetes.io/job-name']": job["metadata"]["name"]}
    env = {e["name"]: e["value"] if "value" in e else downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
           for e in train["env"]}
    monkeypatch.setattr("socket.gethostname", lambda: "resnet-ddp-0-x7k2p")
    assert node_from_env(env) == "gpu-node-17"
    # the daemon's own scrape target carries the same node (ServiceMonitor: instance = node name)
    relabel = one("ServiceMonitor")["spec"]["endpoints"][0]["relabelings"][0]
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]


def test_prometheusrules_equal_alerts():
    rules = [o for o in load_all(K8S / "prometheusrule.yaml")]
    alert_files = sorted((ROOT / "alerts").glob("*.rules.yml"))
    assert alert_files, "alerts/*.rules.yml missing"
    assert len(rules) == len(alert_files)
    for path, rule in zip(alert_files, rules):
        assert rule["spec"]["groups"] == yaml.safe_load(path.read_text())["groups"], path.name


def test_dashboard_configmaps_equal_dashboards():
    maps = load_all(K8S / "dashboards.yaml")
    dashboards = sorted((ROOT / "dashboards" / "json").glob("*.json"))
    assert dashboards, "dashboards/json/*.json missing"
    assert [list(m["data"]) for m in maps] == [[p.name] for p in dashboards]
    for path, cm in zip(dashboards, maps):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        text = cm["data"][path.name]
        assert text == path.read_text()
        json.loads(text)
        # kubectl's client-side apply keeps a copy in an annotation capped at 256 KiB.
        assert len(text.encode()) < 256 * 1024, f"{path.name} too large for kubectl apply"


def test_generated_files_are_current():
    assert _generate_module().main(["--check"]) == 0, "run python deploy/kubernetes/generate.py"


def test_generate_check_detects_stale_output(tmp_path, monkeypatch):
    gen = _generate_module()
    monkeypatch.setattr(gen, "HERE", tmp_path)
    assert gen.main(["--check"]) == 1  # nothing written yet
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    with open(tmp_path / "prometheusrule.yaml", "a") as f:
        f.write("# hand edit\n")
    assert gen.main(["--check"]) == 1


def test_kustomization_lists_existing_files_and_builds():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        assert (K8S / name).is_file(), name
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    built = {(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(out) if o}
    assert built == {(o["kind"], o["metadata"]["name"]) for o in kustomized_objects()}
