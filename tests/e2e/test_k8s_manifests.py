"""The Kubernetes manifests (k8s/): every kustomization renders with `kubectl kustomize`, every object it renders
validates offline against the Kubernetes OpenAPI schemas in strict mode (an unknown or misspelt key is an error),
and the manifests agree with the programs they run:

- every tandem-train / tandem-serve flag exists in that binary's --help (and launch's, for `tandem-train launch`);
- a trainer pod's nvidia.com/gpu equals the --ranks it launches, --nnodes equals the Job's completions and
  parallelism, the Job is Indexed and the node rank is the completion index;
- --master-addr is pod 0's name under a headless Service that publishes not-ready addresses and selects the
  trainer pods, and --master-port is that Service's rendezvous port;
- --rollout-servers names exactly the StatefulSet's replicas, on its control port, through its headless Service;
- a rollout server has one GPU for --device cuda, its ports match --port/--control, and its readiness and liveness
  probes are GET /health on the HTTP port;
- GPU trainer pods mount a memory-backed /dev/shm;
- the training config in the ConfigMap, with the manifest's flags, passes tandem-train's own option checks;
- each overlay has the size it advertises, and spreads its pods one per node where it has several;
- the control channel is authenticated: servers and trainer read their CURVE keys from one Secret whose keys are
  the files `tandem-train keygen` writes, and NetworkPolicies admit only the run's pods to the pods of the run.

The renderer and the validator come from tests/requirements-k8s.txt (scripts/setup.sh installs them into the
test venv); without them the tests skip, saying so.
"""
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, ROOT  # noqa: E402

K8S = ROOT / "k8s"
# The oldest Kubernetes the manifests claim to work with, and the newest schemas the validator ships.
KUBE_VERSIONS = ("1.29.0", None)
KUSTOMIZATIONS = sorted(p.parent.relative_to(K8S).as_posix() for p in K8S.rglob("kustomization.yaml"))
# What each overlay says it deploys: (trainer pods, ranks per pod, rollout servers).
SIZES = {"base": (1, 1, 1), "overlays/single-node": (1, 7, 1), "overlays/mixed-pool": (4, 7, 4)}


def kubectl():
    exe = pathlib.Path(sys.executable).parent / "kubectl"
    if not exe.exists():
        pytest.skip(f"{exe} is missing: scripts/setup.sh installs tests/requirements-k8s.txt into the test venv")
    return str(exe)


def render(rel):
    p = subprocess.run([kubectl(), "kustomize", str(K8S / rel)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"kubectl kustomize k8s/{rel} failed:\n{p.stderr}"
    docs = [d for d in yaml.safe_load_all(p.stdout) if d is not None]
    assert docs, f"k8s/{rel} renders nothing"
    return docs


def binary(name):
    exe = (BUILD / "bin" / name).resolve()
    if not exe.exists():
        pytest.skip(f"{exe} is not built (run scripts/test.sh, or set TANDEM_BUILD_DIR)")
    return str(exe)


_help_cache = {}


def help_flags(*argv):
    """The flags a binary's --help lists (lines that start with an option)."""
    if argv not in _help_cache:
        exe = binary(argv[0])
        p = subprocess.run([exe, *argv[1:], "--help"], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        _help_cache[argv] = set(re.findall(r"^\s+(--[a-z0-9][a-z0-9-]*)", p.stdout, re.M))
        assert len(_help_cache[argv]) > 5, p.stdout
    return _help_cache[argv]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(docs):
    """(object, pod spec) for everything that makes pods."""
    out = []
    for d in docs:
        if d["kind"] == "Pod":
            out.append((d, d["spec"]))
        elif d["kind"] in ("Job", "StatefulSet", "Deployment", "DaemonSet"):
            out.append((d, d["spec"]["template"]["spec"]))
    return out


def expand(text, env, where):
    """Kubernetes' $(VAR) expansion in command and args; a reference to an unknown variable is a mistake (Kubernetes
    would pass it on literally)."""
    def sub(m):
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is not a variable of the container"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def container_argv(obj, pod, c, index=0):
    """The container's argv as the kubelet builds it, with JOB_COMPLETION_INDEX = index for an indexed Job."""
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    if obj["kind"] == "Job" and obj["spec"].get("completionMode") == "Indexed":
        env["JOB_COMPLETION_INDEX"] = str(index)
    where = f'{obj["kind"]} {obj["metadata"]["name"]} container {c["name"]}'
    return [expand(str(a), env, where) for a in c.get("command", []) + c.get("args", [])]


def split_launch(argv):
    """tandem-train launch argv -> (launch options {flag: value}, trainer argv after --)."""
    assert argv[:2] == ["tandem-train", "launch"], argv
    rest = argv[2:]
    cut = rest.index("--") if "--" in rest else len(rest)
    opts, toks = {}, rest[:cut]
    i = 0
    while i < len(toks):
        flag = toks[i]
        assert flag.startswith("--"), f"launch: stray value {flag!r} in {argv}"
        if "=" in flag:
            k, v = flag.split("=", 1)
            opts.setdefault(k, []).append(v)
            i += 1
        else:
            assert i + 1 < len(toks), f"launch: {flag} has no value"
            opts.setdefault(flag, []).append(toks[i + 1])
            i += 2
    return {k: v[-1] for k, v in opts.items()}, opts.get("--server-arg", []), rest[cut + 1:]


def flag_value(argv, flag):
    vals = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    vals += [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    return vals[-1] if vals else None


def flags_in(argv):
    return {a.split("=", 1)[0] for a in argv if a.startswith("--") and a != "--"}


def gpu(c, kind="limits"):
    return int(c.get("resources", {}).get(kind, {}).get("nvidia.com/gpu", 0))


def selects(service, labels):
    sel = service["spec"].get("selector") or {}
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


def trainer_parts(docs):
    jobs = [(o, p, c) for o, p in workloads(docs) for c in p["containers"] if c.get("command", [""])[0] == "tandem-train"]
    return jobs


def server_parts(docs):
    return [(o, p, c) for o, p in workloads(docs) for c in p["containers"] if c.get("command", [""])[0] == "tandem-serve"]


# ---- rendering and schemas -------------------------------------------------------------------------------------


def test_every_manifest_file_is_rendered():
    """A YAML file that no kustomization names would never be validated (nor deployed)."""
    named = set()
    for rel in KUSTOMIZATIONS:
        k = yaml.safe_load((K8S / rel / "kustomization.yaml").read_text())
        for key in ("resources", "components"):
            for r in k.get(key, []):
                named.add((K8S / rel / r).resolve())
        for p in k.get("patches", []):
            if "path" in p:
                named.add((K8S / rel / p["path"]).resolve())
        for g in k.get("configMapGenerator", []):
            for f in g.get("files", []):
                named.add((K8S / rel / f.split("=")[-1]).resolve())
    files = [p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml", ".json") and p.name != "kustomization.yaml"]
    orphans = [str(p.relative_to(ROOT)) for p in files if p.resolve() not in named]
    assert not orphans, f"not named by any kustomization: {orphans}"
    assert {"base", "overlays/single-node", "overlays/mixed-pool"} <= set(KUSTOMIZATIONS)


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_renders_and_validates_strictly(rel):
    kv = pytest.importorskip("kubernetes_validate", reason="scripts/setup.sh installs tests/requirements-k8s.txt")
    docs = render(rel)
    for version in KUBE_VERSIONS:
        v = version or kv.latest_version()
        if not v.count(".") == 2:
            v += ".0"
        for d in docs:
            try:
                kv.validate(d, v, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f'k8s/{rel}: {d["kind"]} {d["metadata"]["name"]} is not valid Kubernetes {v}: {e}')
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), f"k8s/{rel}: duplicate objects {names}"


# ---- the manifests and the programs ----------------------------------------------------------------------------


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_flags_exist(rel):
    docs = render(rel)
    for obj, pod, c in trainer_parts(docs) + server_parts(docs):
        argv = container_argv(obj, pod, c)
        where = f'k8s/{rel}: {obj["kind"]} {obj["metadata"]["name"]}'
        if argv[0] == "tandem-serve":
            unknown = flags_in(argv[1:]) - help_flags("tandem-serve")
            assert not unknown, f"{where}: tandem-serve has no {sorted(unknown)}"
            continue
        assert argv[1] == "launch", f"{where}: the trainer pods run `tandem-train launch`"
        opts, server_args, train = split_launch(argv)
        unknown = set(opts) - help_flags("tandem-train", "launch")
        assert not unknown, f"{where}: tandem-train launch has no {sorted(unknown)}"
        unknown = flags_in(server_args) - help_flags("tandem-serve")
        assert not unknown, f"{where}: tandem-serve has no {sorted(unknown)} (--server-arg)"
        unknown = flags_in(train) - help_flags("tandem-train")
        assert not unknown, f"{where}: tandem-train has no {sorted(unknown)}"


@pytest.mark.parametrize("rel", [r for r in KUSTOMIZATIONS if r in SIZES])
def test_trainer_contract(rel):
    docs = render(rel)
    trainers = trainer_parts(docs)
    assert len(trainers) == 1, f"k8s/{rel}: expected one trainer workload"
    job, pod, c = trainers[0]
    where = f"k8s/{rel}: Job {job['metadata']['name']}"
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed", where
    nodes = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == nodes, f"{where}: every node's pod must run at once"
    assert pod["restartPolicy"] == "Never"
    gpus = gpu(c)
    assert gpus >= 1 and gpu(c, "requests") in (0, gpus), f"{where}: nvidia.com/gpu requests and limits differ"
    for index in range(nodes):
        opts, _, train = split_launch(container_argv(job, pod, c, index))
        assert int(opts["--ranks"]) == gpus, f"{where}: --ranks {opts['--ranks']} but nvidia.com/gpu {gpus}"
        assert int(opts["--nnodes"]) == nodes, f"{where}: --nnodes {opts['--nnodes']} but {nodes} completions"
        assert opts["--node-rank"] == str(index), f"{where}: pod {index} gets --node-rank {opts['--node-rank']}"
    # Rendezvous: pod 0's stable name through a headless Service that exists before pods are ready.
    sub = pod.get("subdomain")
    assert sub, f"{where}: pods need a subdomain (the headless Service) for stable names"
    svc = one(docs, "Service", sub)
    assert svc["spec"].get("clusterIP") == "None", f"{where}: Service {sub} must be headless"
    assert svc["spec"].get("publishNotReadyAddresses") is True, f"{where}: Service {sub} must publish not-ready pods"
    assert selects(svc, pod_labels(job)), f"{where}: Service {sub} does not select the trainer pods"
    assert opts["--master-addr"] == f"{job['metadata']['name']}-0.{sub}", f"{where}: --master-addr is not pod 0"
    assert int(opts["--master-port"]) in [p["port"] for p in svc["spec"]["ports"]]
    assert int(opts["--master-port"]) in [p["containerPort"] for p in c.get("ports", [])]
    # Rollout servers: external, every replica listed by its stable name on its control port.
    assert opts["--servers"] == "0", f"{where}: the rollout servers are their own pods"
    sts, spod, sc = one_server(docs, rel)
    ssvc = one(docs, "Service", sts["spec"]["serviceName"])
    assert ssvc["spec"].get("clusterIP") == "None" and selects(ssvc, pod_labels(sts))
    control = port_of(sc, "control")
    want = [f"tcp://{sts['metadata']['name']}-{i}.{ssvc['metadata']['name']}:{control}"
            for i in range(sts["spec"]["replicas"])]
    assert flag_value(train, "--rollout-servers").split(",") == want, f"{where}: --rollout-servers"
    # NCCL between the GPUs of a pod needs more than a container's default 64 MiB of /dev/shm.
    shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    assert shm, f"{where}: no /dev/shm mount"
    vol = [v for v in pod["volumes"] if v["name"] == shm[0]["name"]][0]
    assert vol.get("emptyDir", {}).get("medium") == "Memory", f"{where}: /dev/shm must be an emptyDir in memory"
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    assert env.get("NCCL_NVLS_ENABLE") == "0" and env.get("NCCL_SOCKET_IFNAME")


def pod_labels(obj):
    return obj["spec"]["template"]["metadata"]["labels"] if "template" in obj["spec"] else obj["metadata"]["labels"]


def one_server(docs, rel):
    servers = server_parts(docs)
    assert len(servers) == 1, f"k8s/{rel}: expected one rollout server workload"
    assert servers[0][0]["kind"] == "StatefulSet", f"k8s/{rel}: rollout servers need stable names (StatefulSet)"
    return servers[0]


def port_of(c, name):
    ports = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, f"container {c['name']} has no port named {name}"
    return ports[0]


@pytest.mark.parametrize("rel", [r for r in KUSTOMIZATIONS if r in SIZES])
def test_rollout_servers(rel):
    docs = render(rel)
    sts, pod, c = one_server(docs, rel)
    argv = container_argv(sts, pod, c)
    where = f"k8s/{rel}: StatefulSet {sts['metadata']['name']}"
    if flag_value(argv, "--device").startswith("cuda"):
        assert gpu(c) == 1, f"{where}: tandem-serve uses one GPU; nvidia.com/gpu is {gpu(c)}"
    assert int(flag_value(argv, "--port")) == port_of(c, "http")
    assert flag_value(argv, "--control") == f"tcp://0.0.0.0:{port_of(c, 'control')}", f"{where}: --control"
    assert flag_value(argv, "--host") == "0.0.0.0", f"{where}: the server must listen beyond the pod's loopback"
    for probe in ("readinessProbe", "livenessProbe"):
        get = c.get(probe, {}).get("httpGet", {})
        assert get.get("path") == "/health" and get.get("port") in ("http", port_of(c, "http")), f"{where}: {probe}"
    assert pod.get("terminationGracePeriodSeconds", 30) > int(flag_value(argv, "--drain-timeout") or 30)


@pytest.mark.parametrize("rel", sorted(SIZES))
def test_sizes_and_spread(rel):
    docs = render(rel)
    nodes, ranks, servers = SIZES[rel]
    job, pod, c = trainer_parts(docs)[0]
    sts, spod, sc = one_server(docs, rel)
    assert (job["spec"]["completions"], gpu(c), sts["spec"]["replicas"]) == (nodes, ranks, servers)
    for obj, p, n in ((job, pod, nodes), (sts, spod, servers)):
        if n < 2:
            continue
        terms = p.get("affinity", {}).get("podAntiAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
        assert any(t["topologyKey"] == "kubernetes.io/hostname" and
                   all(pod_labels(obj).get(k) == v for k, v in t["labelSelector"]["matchLabels"].items())
                   for t in terms), f"k8s/{rel}: {obj['kind']} pods are not spread one per node"


@pytest.mark.parametrize("rel", [r for r in KUSTOMIZATIONS if r in SIZES])
def test_training_config_passes_tandem_train(rel):
    """The ConfigMap's JSON and the trainer's flags go through tandem-train's own parser and checks; a model folder
    that does not exist then stops it, which proves it got that far."""
    docs = render(rel)
    job, pod, c = trainer_parts(docs)[0]
    _, _, train = split_launch(container_argv(job, pod, c))
    cfg_path = flag_value(train, "--config")
    mount = [m for m in c["volumeMounts"] if cfg_path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mount) == 1, f"k8s/{rel}: --config {cfg_path} is on no volume"
    vol = [v for v in pod["volumes"] if v["name"] == mount[0]["name"]][0]
    cm = one(docs, "ConfigMap", vol["configMap"]["name"])
    key = cfg_path[len(mount[0]["mountPath"].rstrip("/")) + 1:]
    assert key in cm["data"], f"k8s/{rel}: ConfigMap {cm['metadata']['name']} has no {key}"
    exe = binary("tandem-train")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = pathlib.Path(tmp) / key
        cfg.write_text(cm["data"][key])
        argv = [exe, "--model", str(pathlib.Path(tmp) / "no-model")]
        for a in train:
            argv.append(str(cfg) if a == cfg_path else a)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT")}
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp, env=env)
    assert p.returncode == 1 and "no-model/config.json: cannot open" in p.stderr, \
        f"k8s/{rel}: tandem-train refused the config or the flags (exit {p.returncode}):\n{p.stderr}"


# ---- control channel keys and network policy (issue 22) -------------------------------------------------------


def secret_file(pod, c, path, where):
    """(Secret name, key) of the file at path in container c, which must come from a Secret volume item."""
    mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{where}: {path} is on no volume"
    vol = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]][0]
    assert "secret" in vol, f"{where}: {path} must come from a Secret, not {sorted(vol)}"
    rel_path = path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
    items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
    assert rel_path in items, f"{where}: Secret volume {vol['name']} has no item {rel_path}"
    assert not vol["secret"].get("optional"), f"{where}: the keys must not be optional"
    assert vol["secret"].get("defaultMode", 0o644) & 0o007 == 0, f"{where}: key files readable by others"
    return vol["secret"]["secretName"], items[rel_path]


@pytest.mark.parametrize("rel", [r for r in KUSTOMIZATIONS if r in SIZES])
def test_control_channel_keys(rel, tmp_path):
    """Every rollout server is a CURVE server and every trainer rank its client, with files of one Secret whose
    keys are the files `tandem-train keygen` writes (so `kubectl create secret --from-file` of its folder fits)."""
    docs = render(rel)
    sts, spod, sc = one_server(docs, rel)
    argv = container_argv(sts, spod, sc)
    where = f"k8s/{rel}: StatefulSet {sts['metadata']['name']}"
    used = {secret_file(spod, sc, flag_value(argv, f), where) for f in ("--control-key-file",
                                                                          "--control-authorized-keys")}
    job, pod, c = trainer_parts(docs)[0]
    _, _, train = split_launch(container_argv(job, pod, c))
    where = f"k8s/{rel}: Job {job['metadata']['name']}"
    used |= {secret_file(pod, c, flag_value(train, f), where) for f in ("--control-server-key",
                                                                          "--control-client-key")}
    names = {s for s, _ in used}
    assert len(names) == 1, f"k8s/{rel}: the keys come from several Secrets {names}"
    out = subprocess.run([binary("tandem-train"), "keygen", str(tmp_path / "keys")], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    written = {p.name for p in (tmp_path / "keys").iterdir()}
    assert {k for _, k in used} == written, f"k8s/{rel}: Secret keys {sorted(k for _, k in used)} vs keygen's {written}"
    # The Secret is the user's (never committed): the manifests must not ship one.
    assert not [d for d in docs if d["kind"] == "Secret"], f"k8s/{rel}: a Secret with keys is in the manifests"


def admitted(policy, labels):
    """1 when an ingress rule of policy admits a pod with these labels (on any port)."""
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        assert peers, f"NetworkPolicy {policy['metadata']['name']}: a rule without 'from' admits everyone"
        for p in peers:
            assert set(p) == {"podSelector"}, f"NetworkPolicy {policy['metadata']['name']}: only pods of the run"
            sel = p["podSelector"].get("matchLabels") or {}
            if sel and all(labels.get(k) == v for k, v in sel.items()):
                return True
    return False


@pytest.mark.parametrize("rel", [r for r in KUSTOMIZATIONS if r in SIZES])
def test_network_policy_admits_only_the_run(rel):
    docs = render(rel)
    policies = by_kind(docs, "NetworkPolicy")
    trainer = pod_labels(trainer_parts(docs)[0][0])
    server = pod_labels(one_server(docs, rel)[0])
    stranger = {"app.kubernetes.io/name": "something-else"}

    def policy_of(labels):
        sel = [p for p in policies if all(labels.get(k) == v for k, v in
                                          p["spec"]["podSelector"].get("matchLabels", {}).items())
               and "Ingress" in p["spec"].get("policyTypes", [])]
        assert sel, f"k8s/{rel}: no ingress NetworkPolicy selects pods labelled {labels}"
        return sel

    # Rollout pods (control 5555, HTTP 8000, NCCL): the trainer pods only.
    assert any(admitted(p, trainer) for p in policy_of(server))
    assert not any(admitted(p, stranger) for p in policy_of(server))
    # Trainer pods: each other (rendezvous, collectives) and the servers (NCCL weight sync), nobody else.
    assert any(admitted(p, trainer) for p in policy_of(trainer))
    assert any(admitted(p, server) for p in policy_of(trainer))
    assert not any(admitted(p, stranger) for p in policy_of(trainer))
