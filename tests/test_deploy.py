"""deploy/ agrees with the Kubernetes schemas, its linters, vllm-router and tierkv-serve itself.

The manifests are rendered by kubectl's kustomize (no cluster) and validated with
kubernetes-validate; the Dockerfiles go through hadolint. What they say about the server (the probe
path, the port, the grace period against the drain, the metric KEDA scales on, the L3 URL, the
router's block size) is checked against tierkv-serve's own option parser and
constants, and against a real tierkv-serve started through the `vllm serve` shim the way the vLLM
production-stack chart starts it. The `bash ci` commands of docs/deploy.md run as written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess, free_port
from test_grafana_dashboard import selectors
from tierkv.config import redis_cluster_nodes
from tierkv.engine.loader import bundled_model_dir
from tierkv.server import cli, vllm_shim

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOC = ROOT / "docs" / "deploy.md"
# Kubernetes' own default when a pod spec sets none (the production-stack chart sets none)
K8S_DEFAULT_GRACE_S = 30
# custom resources: kubernetes-validate has no schema for them, their fields are checked below
CRD_KINDS = {"ServiceMonitor", "ScaledObject"}
# labels Prometheus adds to a scraped series (ServiceMonitor targets), not the server
TARGET_LABELS = {"instance", "job", "namespace", "service", "pod", "container", "endpoint"}


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def port_named(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def options(args: list[str]) -> dict:
    """tierkv-serve's options for `args`, as its own parser reads them (and refuses them)."""
    try:
        return cli.load_options(args)
    except SystemExit:
        pytest.fail(f"tierkv-serve refuses `{shlex.join(args)}` (its message is in the captured stderr)")


def events_port(opts_args: list[str], key: str = "endpoint") -> int:
    """The ZMQ port of the --kv-events-config `key` (tcp://*:PORT): the events, or the replay."""
    config = json.loads(opts_args[opts_args.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] and config["publisher"] == "zmq"
    return int(config[key].rsplit(":", 1)[1])


def servers(docs: list[dict]) -> dict:
    return one(docs, "StatefulSet", "tierkv-serve")


def values(name: str) -> dict:
    return yaml.safe_load((DEPLOY / "helm" / name).read_text())


def image_model_dir() -> str:
    """Where deploy/Dockerfile puts its converted copy of the bundled model, checked to be readable
    by the server's user (a converted model is written owner-only)."""
    text = (DEPLOY / "Dockerfile").read_text()
    found = re.search(r"copytree\(bundled_model_dir\([^)]*\), sys\.argv\[1\]\)\" (/\S+)", text)
    assert found, "deploy/Dockerfile converts no copy of the bundled model"
    chmod = re.search(r"chmod -R a\+rX (/\S+)", text)
    assert chmod and found.group(1).startswith(chmod.group(1).rstrip("/") + "/"), "the model is left owner-only"
    return found.group(1)


def env_of(entries: list[dict]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in entries}


def production_stack_command(values: dict) -> list[str]:
    """The engine's command line as production-stack's chart writes it (helm/templates/
    deployment-vllm-multi.yaml at a6c01db0: `vllm serve`, the model, host, port, then the
    vllmConfig flags in the template's order, then extraArgs)."""
    engine = values["servingEngineSpec"]
    (spec,) = engine["modelSpec"]
    vc = spec.get("vllmConfig", {})
    cmd = ["vllm", "serve", spec["modelURL"], "--host", "0.0.0.0", "--port", str(engine.get("containerPort", 8000))]
    if "enableChunkedPrefill" in vc:
        cmd.append("--enable-chunked-prefill" if vc["enableChunkedPrefill"] else "--no-enable-chunked-prefill")
    cmd.append("--enable-prefix-caching" if vc.get("enablePrefixCaching") else "--no-enable-prefix-caching")
    for key, flag in (("maxModelLen", "--max-model-len"), ("dtype", "--dtype"),
                      ("tensorParallelSize", "--tensor-parallel-size"), ("maxNumSeqs", "--max-num-seqs"),
                      ("gpuMemoryUtilization", "--gpu_memory_utilization")):
        if key in vc:
            cmd += [flag, str(vc[key])]
    return cmd + [str(a) for a in vc.get("extraArgs", [])]


# ---------------------------------------------------------------------------------------- schemas


def test_manifests_validate_against_the_kubernetes_schemas(rendered):
    kinds = {d["kind"] for d in rendered}
    assert {"Deployment", "Service", "StatefulSet", "Job", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    assert kinds & CRD_KINDS == CRD_KINDS  # checked by hand below, and nothing else is skipped
    for version in ("1.30", kubernetes_validate.latest_version()):
        for doc in rendered:
            if doc["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(doc, version, strict=True)


def test_dockerfiles_pass_hadolint():
    for name in ("Dockerfile", "router.Dockerfile"):
        out = subprocess.run(["hadolint", str(DEPLOY / name)], capture_output=True, text=True)
        assert out.returncode == 0, f"{name}:\n{out.stdout}{out.stderr}"


def test_image(rendered):
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+$", text, re.M)
    assert "bash scripts/install.sh" in text  # the README's install
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1].split(":")[0].isdigit() and int(user[-1].split(":")[0]) > 0
    assert json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1)) == ["tierkv-serve"]
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    opts = options(cmd)
    assert opts["host"] == "0.0.0.0" and opts["port"] == cli.DEFAULT_PORT
    serve = container(servers(rendered))
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    assert exposed == {cli.DEFAULT_PORT, events_port(serve["args"]), events_port(serve["args"], "replay_endpoint")}
    # `vllm` in the image is the shim's console script
    link = re.search(r"ln -s /opt/venv/bin/(\S+) /usr/local/bin/vllm", text).group(1)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[link] == f"{vllm_shim.__name__}:main"


# ------------------------------------------------------------------------------------ tierkv-serve


def test_server_listens_where_it_is_probed_and_scraped(rendered):
    sts = servers(rendered)
    c = container(sts)
    opts = options(c["args"])
    assert opts["host"] == "0.0.0.0"  # the default (127.0.0.1) is unreachable from the kubelet and the router
    assert port_named(c, "http") == opts["port"]
    assert port_named(c, "kv-events") == events_port(c["args"])
    assert port_named(c, "kv-replay") == events_port(c["args"], "replay_endpoint")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "http"
    # the headless Service that names each pod (tierkv-serve-0.tierkv-serve, ...)
    svc = one(rendered, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {
        "http": "http", "kv-events": "kv-events", "kv-replay": "kv-replay"}
    # KEDA's scale-ups start pods at once; updates replace one pod at a time, drained as a deletion is
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    pdb = one(rendered, "PodDisruptionBudget", "tierkv-serve")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "nvidia.com/gpu" in c["resources"]["limits"]
    assert c["env"][0]["name"] == cli.API_KEY_ENV and "secretKeyRef" in c["env"][0]["valueFrom"]
    assert "--api-key" not in c["args"]  # a secret stays off the command line


def drain_s(args: list[str], pre_stop: dict | None) -> float:
    """Seconds from the kubelet's decision to stop a pod to the server's exit, at most."""
    opts = options(args)
    sleep = float(pre_stop["exec"]["command"][1]) if pre_stop else 0.0
    return sleep + opts["grace_period"] + cli.SHUTDOWN_SLACK_S + opts["flush_timeout"]


def test_grace_period_covers_the_drain(rendered):
    sts = servers(rendered)
    c = container(sts)
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= \
        drain_s(c["args"], c["lifecycle"]["preStop"])
    decode = values("llm-d-modelservice.values.yaml")["decode"]
    (llmd,) = decode["containers"]
    assert decode["terminationGracePeriodSeconds"] >= drain_s(llmd["args"], llmd["extraConfig"]["lifecycle"]["preStop"])
    shim_args = vllm_shim.translate(production_stack_command(values("production-stack.values.yaml"))[1:])
    assert drain_s(shim_args, None) <= K8S_DEFAULT_GRACE_S


def test_autoscaling_and_scraping_target_the_servers(rendered):
    so = one(rendered, "ScaledObject", "tierkv-serve")
    sts = servers(rendered)
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "tierkv-serve"}
    assert "replicas" not in sts["spec"]  # KEDA owns the count; re-applying must not reset it
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    ((name, matchers),) = selectors(trigger["metadata"]["query"])
    assert matchers == {"namespace": sts["metadata"]["namespace"], "service": "tierkv-serve"}
    sm = one(rendered, "ServiceMonitor", "tierkv-serve")
    svc = one(rendered, "Service", "tierkv-serve")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]} and endpoint["path"] == "/metrics"


def test_l3_is_the_redis_cluster_of_the_manifests(rendered):
    sts = one(rendered, "StatefulSet", "tierkv-redis")
    ns = sts["metadata"]["namespace"]
    n = sts["spec"]["replicas"]
    pods = [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}" for i in range(n)]
    port = port_named(container(sts), "redis")
    job = container(one(rendered, "Job", "tierkv-redis-init"))
    assert f"for i in {' '.join(map(str, range(n)))}; do" in job["command"][-1]
    assert "cluster-enabled yes" in one(rendered, "ConfigMap", "tierkv-redis")["data"]["redis.conf"]
    serve = servers(rendered)
    (url,) = options(container(serve)["args"])["l3"]
    assert redis_cluster_nodes(url) == [(p, port) for p in pods]
    # the chart values reach the same cluster from another namespace
    (llmd,) = values("llm-d-modelservice.values.yaml")["decode"]["containers"]
    shim_args = vllm_shim.translate(production_stack_command(values("production-stack.values.yaml"))[1:])
    for args in (llmd["args"], shim_args):
        (url,) = options(args)["l3"]
        assert redis_cluster_nodes(url) == [(f"{p}.{ns}.svc", port) for p in pods]
    # the NetworkPolicy lets the servers in
    policy = one(rendered, "NetworkPolicy", "tierkv-redis")
    clients = policy["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"]
    assert clients.items() <= serve["spec"]["template"]["metadata"]["labels"].items()
    assert clients.items() <= values("llm-d-modelservice.values.yaml")["modelArtifacts"]["labels"].items()
    assert clients.items() <= values("production-stack.values.yaml")["servingEngineSpec"]["modelSpec"][0][
        "podLabels"].items()


# ------------------------------------------------------------------------------------------ router


def router_flags() -> set[str]:
    out = subprocess.run(["vllm-router", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out.stdout))


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def repeated(args: list[str], name: str) -> dict[str, str]:
    """{worker URL: endpoint} from each `name URL=ENDPOINT` in `args`."""
    pairs = [args[i + 1].split("=", 1) for i, a in enumerate(args) if a == name]
    assert len({url for url, _ in pairs}) == len(pairs), f"{name} names a worker twice"
    return dict(pairs)


def probe_window_s(c: dict) -> int:
    return c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]


def test_router_runs_kv_aware_over_the_servers(rendered):
    router = one(rendered, "Deployment", "tierkv-router")
    r = container(router)
    args = r["args"]
    unknown = {a for a in args if a.startswith("--")} - router_flags()
    assert not unknown, f"vllm-router 0.1.17 has no {unknown}"
    assert flag(args, "--policy") == "kv_aware"
    sts = servers(rendered)
    c = container(sts)
    opts = options(c["args"])
    assert int(flag(args, "--kv-event-block-size")) == opts["block_size"]
    # required beside static event sources; any name (tests/test_routers.py routes under another)
    assert flag(args, "--kv-event-model")
    # every pod KEDA may run, by its name in the headless Service, in the router's own namespace
    # (short names resolve there only); vllm-router 0.1.17 subscribes to no discovered source
    n = one(rendered, "ScaledObject", "tierkv-serve")["spec"]["maxReplicaCount"]
    assert router["metadata"]["namespace"] == sts["metadata"]["namespace"]
    hosts = [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}" for i in range(n)]
    urls = [f"http://{h}:{port_named(c, 'http')}" for h in hosts]
    start = args.index("--worker-urls") + 1
    listed = args[start:next(i for i in range(start, len(args)) if args[i].startswith("--"))]
    assert listed == urls
    assert repeated(args, "--kv-event-source") == {
        u: f"tcp://{h}:{events_port(c['args'])}" for u, h in zip(urls, hosts)}
    assert repeated(args, "--kv-event-replay-source") == {
        u: f"tcp://{h}:{events_port(c['args'], 'replay_endpoint')}" for u, h in zip(urls, hosts)}
    assert not {a for a in args if a.startswith("--service-discovery") or a == "--selector"}
    assert "serviceAccountName" not in router["spec"]["template"]["spec"]
    assert not {d["kind"] for d in rendered} & {"ServiceAccount", "Role", "RoleBinding"}
    # the router listens once a replica is healthy and exits if none is by its startup timeout:
    # that wait covers a replica's model load, and the router's own startupProbe covers the wait
    assert probe_window_s(r) >= int(flag(args, "--worker-startup-timeout-secs")) >= probe_window_s(c)


def test_the_routers_metrics_are_scraped(rendered, served):
    """A ServiceMonitor scrapes the router's own metrics: its Service's port reaches the container
    port the router's --prometheus-port serves, bound for the cluster; a real vllm-router serves
    them on that port and path."""
    r = container(one(rendered, "Deployment", "tierkv-router"))
    args = r["args"]
    sm, svc = one(rendered, "ServiceMonitor", "tierkv-router"), one(rendered, "Service", "tierkv-router")
    release = one(rendered, "ServiceMonitor", "tierkv-serve")["metadata"]["labels"]["release"]
    assert sm["metadata"]["labels"]["release"] == release  # the label the Prometheus selects by
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port_named(r, port["targetPort"]) == int(flag(args, "--prometheus-port"))
    assert flag(args, "--prometheus-host") == "0.0.0.0"
    srv, _ = served
    prometheus_port = free_port()
    proc = subprocess.Popen(["vllm-router", "--worker-urls", srv.url, "--policy", "round_robin", "--host", "127.0.0.1",
                             "--port", str(free_port()), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                             str(prometheus_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url, text, end = f"http://127.0.0.1:{prometheus_port}{endpoint['path']}", "", time.monotonic() + 60
        while "vllm_router_active_workers" not in text and time.monotonic() < end and proc.poll() is None:
            try:
                text = httpx.get(url, timeout=5).text
            except httpx.HTTPError:
                time.sleep(0.3)
        names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        assert "vllm_router_active_workers" in names, f"{url}: {text[:300]!r}"
    finally:
        proc.terminate()
        proc.wait(30)


# ---------------------------------------------------------------------------------------- the shim


def test_shim_maps_vllm_serve_onto_tierkv_serve():
    t = vllm_shim.translate
    assert t(["serve", "org/m", "--host", "0.0.0.0", "--port=8000", "--max_model_len", "4096",
              "--enable-prefix-caching", "--disable-log-requests", "--enable-chunked-prefill", "-tp", "2"]) == \
        ["--model", "org/m", "--host", "0.0.0.0", "--port", "8000", "--max-model-len", "4096",
         "--enable-prefix-caching", "-tp", "2"]
    assert t(["serve", "--model", "org/m", "--no-enable-prefix-caching"]) == ["--model", "org/m",
                                                                            "--no-enable-prefix-caching"]
    assert t(["serve", "--l2", "16GiB"]) == ["--l2", "16GiB"]  # no model: the bundled one
    for argv, words in [
        (["serve", "m/x", "--gpu-memory-utilization", "0.9"], ["--gpu-memory-utilization", "--l1"]),
        (["serve", "m/x", "--gpu_memory_utilization=0.9"], ["--gpu-memory-utilization", "--l1"]),
        (["serve", "m/x", "--no-enable-chunked-prefill"], ["--max-num-batched-tokens"]),
        (["serve", "m/x", "--enable-lora"], ["LoRA"]),
        (["serve", "m/x", "--speculative-config", "{}"], ["unknown option '--speculative-config'"]),
        (["serve", "m/x", "m/y"], ["one model"]),
        (["serve", "m/x", "--model", "m/y"], ["twice"]),
        (["serve", "m/x", "--port"], ["--port needs a value"]),
        (["serve", "m/x", "--enforce-eager=1"], ["takes no value"]),
        (["chat", "m/x"], ["only `vllm serve`"]),
    ]:
        with pytest.raises(vllm_shim.ShimError) as err:
            t(argv)
        assert all(w in str(err.value) for w in words), (argv, str(err.value))


def test_shim_dry_run_checks_and_never_shows_the_key(capsys):
    assert vllm_shim.main(["serve", "org/m", "--api-key", "s3cret", "--port", "9000", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == "tierkv-serve --model org/m --api-key '***' --port 9000" and "s3cret" not in out
    assert vllm_shim.main(["serve", "org/m", "--max-model-len", "1", "--dry-run"]) == 2
    assert "max_model_len" in capsys.readouterr().err
    assert vllm_shim.main(["serve", "org/m", "--swap-space", "4"]) == 2
    assert "--l2" in capsys.readouterr().err
    assert vllm_shim.main(["serve", "--help"]) == 0 and "--gpu-memory-utilization" in capsys.readouterr().out


def test_chart_values_start_tierkv_serve():
    v = values("llm-d-modelservice.values.yaml")
    (c,) = v["decode"]["containers"]
    assert c["modelCommand"] == "custom" and c["command"] == ["tierkv-serve"]
    opts = options(c["args"])
    assert opts["host"] == "0.0.0.0" and opts["port"] == v["routing"]["servicePort"]
    assert opts["served_model_name"] == v["modelArtifacts"]["name"]
    assert v["routing"]["proxy"]["enabled"] is False  # else the sidecar owns servicePort
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": opts["port"],
                                                                  "kv-events": events_port(c["args"])}
    assert v["decode"]["monitoring"]["podmonitor"]["portName"] == "http"
    ps = values("production-stack.values.yaml")
    cmd = production_stack_command(ps)
    opts = options(vllm_shim.translate(cmd[1:]))
    (spec,) = ps["servingEngineSpec"]["modelSpec"]
    assert opts["model"] == spec["modelURL"] and opts["host"] == "0.0.0.0" and opts["enable_prefix_caching"]
    assert opts["served_model_name"] == v["modelArtifacts"]["name"]
    assert ps["servingEngineSpec"]["vllmApiKey"]["secretName"] == "tierkv-api-key"
    (trigger,) = spec["keda"]["triggers"]  # a list, as KEDA needs (docs/deploy.md: the chart's schema)
    assert selectors(trigger["metadata"]["query"])[0][1] == {"model_name": opts["served_model_name"]}


def test_chart_values_serve_the_images_model_with_no_hub():
    """Both charts serve the model the image carries (deploy/Dockerfile's converted copy of the
    bundled SmolLM2) and never reach for the Hub: nothing to download at start or at a restart,
    and no volume for a download (production-stack's HF_HOME is /tmp, emptied by every restart)."""
    model_dir = image_model_dir()
    v = values("llm-d-modelservice.values.yaml")
    (c,) = v["decode"]["containers"]
    assert options(c["args"])["model"] == model_dir
    assert c["mountModelVolume"] is False and env_of(c["env"])["HF_HUB_OFFLINE"] == "1"
    (spec,) = values("production-stack.values.yaml")["servingEngineSpec"]["modelSpec"]
    assert options(vllm_shim.translate(production_stack_command(values("production-stack.values.yaml"))[1:]))[
        "model"] == spec["modelURL"] == model_dir
    assert "pvcStorage" not in spec and env_of(spec["env"])["HF_HUB_OFFLINE"] == "1"


# ------------------------------------------------------------------------ a real server via the shim

KEY = "deploy-test-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory, rendered):
    """tierkv-serve started as production-stack starts an engine (`vllm serve MODEL ...` with
    VLLM_API_KEY and PROMETHEUS_MULTIPROC_DIR set), serving the manifests' model name. MODEL is a
    converted copy of the bundled model, as the image holds one (deploy/Dockerfile copies what
    `bundled_model_dir` makes), with the Hub out of reach: offline, and its endpoint a closed port."""
    tmp = tmp_path_factory.mktemp("deploy")
    name = options(container(servers(rendered))["args"])["served_model_name"]
    offline = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp / "hf")}
    srv = ServerProcess([str(bundled_model_dir()), "--host", "127.0.0.1", "--enable-prefix-caching",
                         "--served-model-name", name, "--l1", "4MiB", "--log-level", "warning",
                         "--disable-log-requests"],
                        tmp / "serve.log", command=("-m", "tierkv.server.vllm_shim", "serve"),
                        env={"OMP_NUM_THREADS": "1", vllm_shim.API_KEY_ENV: KEY, "PROMETHEUS_MULTIPROC_DIR": str(tmp),
                             **offline})
    try:
        srv.wait_ready()
        yield srv, name
    finally:
        srv.stop()


def test_the_shim_serves_with_vllms_key(served):
    srv, name = served
    assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 401
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [name]
    # the image's model answers, with the Hub out of reach
    r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": name, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_probes_and_queries_meet_the_real_server(served, rendered):
    srv, name = served
    c = container(servers(rendered))
    llmd = values("llm-d-modelservice.values.yaml")["decode"]["containers"][0]["extraConfig"]
    paths = {c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    paths |= {llmd[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    for path in paths:
        assert httpx.get(srv.url + path, timeout=30).status_code == 200, path
    text = httpx.get(srv.url + one(rendered, "ServiceMonitor", "tierkv-serve")["spec"]["endpoints"][0]["path"],
                     timeout=30).text
    exported: dict[str, list[dict]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, []).append(sample.labels)
    (spec,) = values("production-stack.values.yaml")["servingEngineSpec"]["modelSpec"]
    queries = [one(rendered, "ScaledObject", "tierkv-serve")["spec"]["triggers"][0]["metadata"]["query"],
               spec["keda"]["triggers"][0]["metadata"]["query"]]
    for query in queries:
        for metric, matchers in selectors(query):
            assert metric in exported, f"{query}: tierkv-serve exports no {metric}"
            for label, value in matchers.items():
                if label not in TARGET_LABELS:
                    assert any(s.get(label) == value for s in exported[metric]), f"{query}: no {label}={value!r}"


# -------------------------------------------------------------------------------------------- docs


def doc_commands() -> list[str]:
    return re.findall(r"^```bash ci\n(.*?)^```", DOC.read_text(), re.M | re.S)


def test_the_docs_commands_run(tmp_path):
    blocks = doc_commands()
    assert len(blocks) >= 4
    env = dict(os.environ)
    if shutil.which("tierkv-vllm") is None:  # the console script of a non-editable checkout's pyproject
        shim = tmp_path / "tierkv-vllm"
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m tierkv.server.vllm_shim "$@"\n')
        shim.chmod(0o755)
        env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    for block in blocks:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, f"docs/deploy.md:\n{block}\n{out.stdout}{out.stderr}"
