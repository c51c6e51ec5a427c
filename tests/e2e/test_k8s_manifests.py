"""The Kubernetes manifests (k8s/): every kustomization renders with `kubectl kustomize`; every built-in object
validates offline against the Kubernetes 1.29 and newest OpenAPI schemas in strict mode (an unknown or misspelt
key is an error), every custom resource against its vendored CRD (tests/e2e/k8s-crds/, JobSet v0.12.0 and Kueue
v0.19.2) in strict mode, and each JobSet Job template against the Kubernetes Job schema too. Then the manifests
against the programs they run and the controllers that run them (tests/e2e/k8s_pods.py builds the pods as the JobSet
and Job controllers and the kubelet would):

- every tandem-train / tandem-serve flag exists in that binary's --help (and launch's, for `tandem-train launch`);
- the run is one JobSet: rollout servers first, the trainer created once they are ready, the run complete when
  the trainer is, restarted as a whole on failure (evictions not counted), resumed from the latest checkpoint
  (grpo.json "resume": "auto", which tandem-train's parser accepts);
- in every trainer pod, the environment the kubelet builds gives `tandem-train launch` NNODES = the trainer Job's
  completions = parallelism, NODE_RANK = the pod's completion index, --ranks = the nvidia.com/gpu limit,
  MASTER_ADDR = trainer pod 0's host name in the JobSet's subdomain, MASTER_PORT = its rendezvous port, and
  --rollout-servers = every rollout pod's host name on its control port;
- a rollout server has one GPU for --device cuda, its ports match --port/--control, and its probes are
  GET /health on the HTTP port;
- each overlay has the size it advertises, spreads its pods one per node where it has several, and pins pods that
  share a ReadWriteOnce volume to one node;
- the Pod Security Standards: every pod meets `restricted`, except the RDMA overlay's, whose only violation (of
  `baseline` too) is the IPC_LOCK capability;
- the nodes: GPU pods select GPU products that the image's CUDA architectures (k8s/container/Dockerfile) run on;
- RDMA: the RDMA overlay gives every GPU pod an RDMA device, IPC_LOCK and NCCL's IB transport, the others none;
- Kueue: the overlays queue the JobSet (label, suspend) in a LocalQueue they ship; no budget blocks node drains;
- the control channel is authenticated (one Secret with `tandem-train keygen`'s files), and NetworkPolicies admit
  only the run's pods, to the rollout pods only on the control and weight ports.

The renderer and the validator come from tests/requirements-k8s.txt (scripts/setup.sh installs them into the
test venv); without them the tests skip, saying so.
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import k8s_crds  # noqa: E402
from k8s_pods import (JOBSET, K8S, container_argv, container_env, flag_value, pods_of, program, render,  # noqa: E402
                      replicated_job, server_container, split_launch, subdomain, the_jobset, trainer_container)
from server_fixtures import BUILD, ROOT  # noqa: E402

# The oldest Kubernetes the manifests claim to work with, and the newest schemas the validator ships.
KUBE_VERSIONS = ("1.29.0", None)
KUSTOMIZATIONS = sorted(p.parent.relative_to(K8S).as_posix() for p in K8S.rglob("kustomization.yaml"))
# What each run says it deploys: (trainer pods, ranks per pod, rollout servers).
SIZES = {"base": (1, 1, 1), "overlays/single-node": (1, 7, 1), "overlays/mixed-pool": (4, 7, 4),
         "overlays/mixed-pool-rdma": (4, 7, 4), "overlays/tp-server": (3, 8, 2)}
RDMA = {"overlays/mixed-pool-rdma"}
PACKED_SERVERS = {"overlays/tp-server"}   # tensor-parallel servers sharing one node
QUEUED = {"overlays/single-node", "overlays/mixed-pool", "overlays/mixed-pool-rdma", "overlays/tp-server"}
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
# GPU Feature Discovery's nvidia.com/gpu.product values (the GPU's name as NVML gives it, spaces as '-'; "NVIDIA
# H200" read on an H200 with nvidia-smi) and the products' compute capabilities (NVIDIA's CUDA GPU table).
COMPUTE_CAPABILITY = {"NVIDIA-H100-80GB-HBM3": (9, 0), "NVIDIA-H200": (9, 0), "NVIDIA-A100-SXM4-80GB": (8, 0)}


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


def all_pods(docs):
    """Every pod the rendered objects make: JobSet pods as k8s_pods builds them, and plain Pods."""
    out = []
    for d in docs:
        if d["kind"] == "JobSet":
            for rj in d["spec"]["replicatedJobs"]:
                out += pods_of(d, rj["name"])
        elif d["kind"] == "Pod":
            out.append({"name": d["metadata"]["name"], "labels": d["metadata"].get("labels", {}),
                        "annotations": {}, "spec": d["spec"], "index": 0, "where": f'Pod {d["metadata"]["name"]}'})
        else:
            assert "template" not in d.get("spec", {}), f'{d["kind"]} {d["metadata"]["name"]}: pods outside the JobSet'
    return out


def flags_in(argv):
    return {a.split("=", 1)[0] for a in argv if a.startswith("--") and a != "--"}


def gpu(c, kind="limits"):
    return int(c.get("resources", {}).get(kind, {}).get("nvidia.com/gpu", 0))


def port_of(c, name):
    ports = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, f"container {c['name']} has no port named {name}"
    return ports[0]


def run_parts(rel):
    docs = render(rel)
    js = the_jobset(docs, rel)
    return docs, js, pods_of(js, "trainer"), pods_of(js, "rollout")


sized = pytest.mark.parametrize("rel", [r for r in KUSTOMIZATIONS if r in SIZES])


# ---- rendering and schemas -------------------------------------------------------------------------------------


def test_every_manifest_file_is_rendered():
    """A YAML file that no kustomization names would never be validated (nor deployed)."""
    named = set()
    for rel in KUSTOMIZATIONS:
        k = yaml.safe_load((K8S / rel / "kustomization.yaml").read_text())
        for key in ("resources", "components", "configurations"):
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
    assert set(SIZES) <= set(KUSTOMIZATIONS)


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_renders_and_validates_strictly(rel):
    kv = pytest.importorskip("kubernetes_validate", reason="scripts/setup.sh installs tests/requirements-k8s.txt")
    docs = render(rel)

    def builtin(d, what):
        for version in KUBE_VERSIONS:
            v = version or kv.latest_version()
            if not v.count(".") == 2:
                v += ".0"
            try:
                kv.validate(d, v, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"k8s/{rel}: {what} is not valid Kubernetes {v}: {e}")

    for d in docs:
        what = f'{d["kind"]} {d["metadata"]["name"]}'
        if k8s_crds.known(d):
            try:
                k8s_crds.validate(d)
            except AssertionError as e:
                pytest.fail(f"k8s/{rel}: {e}")
            if d["apiVersion"] == JOBSET:
                # Each replicated job's template is a Job template: the Kubernetes schema of the Job checks what
                # the CRD's copy of it might lag behind (and the cluster's own version of it, 1.29).
                for rj in d["spec"]["replicatedJobs"]:
                    job = {"apiVersion": "batch/v1", "kind": "Job",
                           "metadata": {"name": f'{d["metadata"]["name"]}-{rj["name"]}-0',
                                        **{k: v for k, v in rj["template"].get("metadata", {}).items()}},
                           "spec": rj["template"]["spec"]}
                    builtin(job, f'{what} replicated job {rj["name"]}')
        else:
            assert "." not in d["apiVersion"].split("/")[0] or d["apiVersion"].split("/")[0].endswith(".k8s.io"), \
                f"k8s/{rel}: {what}: {d['apiVersion']} is a custom resource without a vendored CRD (tests/e2e/k8s-crds)"
            builtin(d, what)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), f"k8s/{rel}: duplicate objects {names}"


def test_crd_validation_refuses_what_the_api_server_would_drop():
    """The strict CRD check is not a check that passes anything: a misspelt field (in the JobSet, in its pod
    template, in the LocalQueue), a wrong type and an unknown failure-policy action are each refused."""
    js = the_jobset(render("base"), "base")
    for mutate, needle in (
            (lambda s: s["spec"].__setitem__("sucessPolicy", {"operator": "All"}), "sucessPolicy"),
            (lambda s: s["spec"]["failurePolicy"].__setitem__("maxRestarts", "three"), "maxRestarts"),
            (lambda s: s["spec"]["failurePolicy"]["rules"][0].__setitem__("action", "Retry"), "action"),
            (lambda s: s["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["containers"][0]
             .__setitem__("imagePullPolice", "Always"), "imagePullPolice")):
        bad = json.loads(json.dumps(js))
        mutate(bad)
        with pytest.raises(AssertionError, match=needle):
            k8s_crds.validate(bad)
    queue = json.loads(json.dumps(one(render("components/kueue"), "LocalQueue", "tandem")))
    k8s_crds.validate(queue)
    queue["spec"]["clusterQueu"] = queue["spec"].pop("clusterQueue")
    with pytest.raises(AssertionError, match="clusterQueu"):
        k8s_crds.validate(queue)


# ---- the manifests and the programs ----------------------------------------------------------------------------


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_flags_exist(rel):
    for pod in all_pods(render(rel)):
        for c in pod["spec"]["containers"]:
            if program(c) not in ("tandem-train", "tandem-serve"):
                continue
            argv = container_argv(pod, c)
            where = f'k8s/{rel}: {pod["where"]}'
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


@sized
def test_jobset_lifecycle(rel):
    """Servers first, trainer once they are ready; the run complete with the trainer; restarts as recovery."""
    docs, js, trainers, servers = run_parts(rel)
    spec, where = js["spec"], f"k8s/{rel}: JobSet {js['metadata']['name']}"
    assert [r["name"] for r in spec["replicatedJobs"]] == ["rollout", "trainer"], where
    assert replicated_job(js, "trainer").get("dependsOn") == [{"name": "rollout", "status": "Ready"}], where
    assert "dependsOn" not in replicated_job(js, "rollout") and "startupPolicy" not in spec, where
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}, where
    assert spec["network"].get("publishNotReadyAddresses") is not False, f"{where}: rendezvous needs not-ready DNS"
    fp = spec["failurePolicy"]
    assert fp["maxRestarts"] >= 1 and fp.get("restartStrategy", "Recreate") == "Recreate", where
    for rj in spec["replicatedJobs"]:
        job = rj["template"]["spec"]
        assert rj.get("replicas", 1) == 1, f"{where}: {rj['name']}: one Job, its pods indexed (host names -0-i)"
        assert job["completions"] == job["parallelism"], f"{where}: {rj['name']}: every pod runs at once"
    trainer_job = replicated_job(js, "trainer")["template"]["spec"]
    # The ranks live and die together: no retry of one pod; the JobSet restarts them all.
    assert trainer_job["backoffLimit"] == 0 and trainer_job["template"]["spec"]["restartPolicy"] == "Never", where
    # Evictions fail the Job with reason PodFailurePolicy, which the first JobSet rule restarts without counting.
    rules = trainer_job["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules, where
    assert fp["rules"][0]["action"] == "RestartJobSetAndIgnoreMaxRestarts" and \
        fp["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"], where
    # A restart resumes: the training config resumes from the latest complete checkpoint when there is one.
    cfg = training_config(docs, trainers[0], rel)
    assert cfg.get("resume") == "auto", f"k8s/{rel}: grpo.json needs \"resume\": \"auto\" for restarts to resume"


@sized
def test_launch_contract(rel):
    """The environment of each trainer pod, as the kubelet builds it, makes the launcher compute the run's layout."""
    docs, js, trainers, servers = run_parts(rel)
    nodes = len(trainers)
    trainer_job = replicated_job(js, "trainer")["template"]["spec"]
    for pod in trainers:
        c = trainer_container(pod)
        env, argv = container_env(pod, c), container_argv(pod, c)
        opts, _, train = split_launch(argv)
        where = f"k8s/{rel}: {pod['where']}"
        gpus = gpu(c)
        assert gpus >= 1 and gpu(c, "requests") in (0, gpus), f"{where}: nvidia.com/gpu requests and limits differ"
        # What launch reads: a flag, else NNODES, NODE_RANK (else JOB_COMPLETION_INDEX), MASTER_ADDR, MASTER_PORT.
        nnodes = opts.get("--nnodes", env.get("NNODES"))
        node_rank = opts.get("--node-rank", env.get("NODE_RANK", env.get("JOB_COMPLETION_INDEX")))
        master = opts.get("--master-addr", env.get("MASTER_ADDR"))
        port = opts.get("--master-port", env.get("MASTER_PORT"))
        assert int(opts["--ranks"]) == gpus, f"{where}: --ranks {opts['--ranks']} but nvidia.com/gpu {gpus}"
        assert int(nnodes) == nodes == trainer_job["completions"], f"{where}: NNODES {nnodes}, {nodes} trainer pods"
        assert node_rank == str(pod["index"]) == env["JOB_COMPLETION_INDEX"], f"{where}: node rank {node_rank}"
        assert master == trainers[0]["fqdn"], f"{where}: MASTER_ADDR {master} is not trainer pod 0 ({trainers[0]['fqdn']})"
        assert int(port) == port_of(c, "rendezvous"), f"{where}: MASTER_PORT {port} is not the rendezvous port"
        assert "PET_NPROC_PER_NODE" not in env and "RANK" not in env and "WORLD_SIZE" not in env, where
        # The rollout servers: external, every rollout pod by its host name, on its control port.
        assert opts["--servers"] == "0", f"{where}: the rollout servers are their own pods"
        want = [f"tcp://{s['fqdn']}:{port_of(server_container(s), 'control')}" for s in servers]
        assert flag_value(train, "--rollout-servers").split(",") == want, f"{where}: --rollout-servers"
        assert re.fullmatch(r"/output/launch-logs-node\d+", opts["--log-dir"]) and \
            opts["--log-dir"].endswith(str(pod["index"])), f"{where}: --log-dir {opts['--log-dir']}"
        # NCCL between the GPUs of a pod needs more than a container's default 64 MiB of /dev/shm.
        shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        assert shm, f"{where}: no /dev/shm mount"
        vol = [v for v in pod["spec"]["volumes"] if v["name"] == shm[0]["name"]][0]
        assert vol.get("emptyDir", {}).get("medium") == "Memory", f"{where}: /dev/shm must be an emptyDir in memory"
        assert env.get("NCCL_NVLS_ENABLE") == "0" and env.get("NCCL_SOCKET_IFNAME"), where
    assert trainers[0]["fqdn"].split(".", 1)[1] == subdomain(js)


@sized
def test_rollout_servers(rel):
    _, js, _, servers = run_parts(rel)
    for pod in servers:
        c = server_container(pod)
        argv = container_argv(pod, c)
        where = f"k8s/{rel}: {pod['where']}"
        if flag_value(argv, "--device").startswith("cuda"):
            tp = int(flag_value(argv, "--tensor-parallel-size") or 1)
            assert gpu(c) == tp, f"{where}: tandem-serve uses {tp} GPU(s) (tensor parallel); nvidia.com/gpu is {gpu(c)}"
        assert int(flag_value(argv, "--port")) == port_of(c, "http")
        assert flag_value(argv, "--control") == f"tcp://0.0.0.0:{port_of(c, 'control')}", f"{where}: --control"
        assert flag_value(argv, "--host") == "0.0.0.0", f"{where}: the server must listen beyond the pod's loopback"
        for probe in ("readinessProbe", "livenessProbe"):
            get = c.get(probe, {}).get("httpGet", {})
            assert get.get("path") == "/health" and get.get("port") in ("http", port_of(c, "http")), f"{where}: {probe}"
        assert pod["spec"].get("terminationGracePeriodSeconds", 30) > int(flag_value(argv, "--drain-timeout") or 30)
        # A crashed server restarts in its pod; the trainer pushes it the weights again.
        assert pod["spec"]["restartPolicy"] == "OnFailure", where


@pytest.mark.parametrize("rel", sorted(SIZES))
def test_sizes_spread_and_volumes(rel):
    docs, js, trainers, servers = run_parts(rel)
    nodes, ranks, n_servers = SIZES[rel]
    assert (len(trainers), gpu(trainer_container(trainers[0])), len(servers)) == (nodes, ranks, n_servers)
    for group in (trainers, servers):
        if len(group) < 2:
            continue
        if rel in PACKED_SERVERS and group is servers:
            # Tensor-parallel servers of a few GPUs each share one node: required together (the first one placed
            # satisfies its own term), and all of them fit its 8 GPUs, so the trainer pods keep whole nodes.
            terms = group[0]["spec"].get("affinity", {}).get("podAffinity", {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution", [])
            assert any(t["topologyKey"] == "kubernetes.io/hostname" and selects_all(t["labelSelector"], group)
                       for t in terms), f"k8s/{rel}: {group[0]['where']}: servers are not required onto one node"
            assert sum(gpu(server_container(p)) for p in group) <= 8, f"k8s/{rel}: the servers overfill a node"
            continue
        terms = group[0]["spec"].get("affinity", {}).get("podAntiAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", [])
        assert any(t["topologyKey"] == "kubernetes.io/hostname" and selects_all(t["labelSelector"], group)
                   for t in terms), f"k8s/{rel}: {group[0]['where']}: pods are not spread one per node"
    # A ReadWriteOnce volume is mounted by one node: every pod that mounts one must be required onto the node of
    # a single pod that mounts it too.
    rwo = {p["metadata"]["name"] for p in by_kind(docs, "PersistentVolumeClaim")
           if "ReadWriteOnce" in p["spec"]["accessModes"]}
    if nodes > 1:
        assert not rwo, f"k8s/{rel}: {sorted(rwo)} are ReadWriteOnce but the run spans {nodes} nodes"
    for claim in rwo:
        users = [p for p in trainers + servers if claim in claims(p)]
        if len(users) == 1:
            continue
        groups = {p["labels"]["app.kubernetes.io/component"]: [q for q in users if q["labels"] == p["labels"]]
                  for p in users}
        anchors = [g for g in groups.values() if len(g) == 1 and not required_affinity(g[0])]
        assert anchors, f"k8s/{rel}: no single pod anchors the node of ReadWriteOnce {claim}"
        for g in groups.values():
            if g is anchors[0]:
                continue
            assert any(t["topologyKey"] == "kubernetes.io/hostname" and selects_all(t["labelSelector"], anchors[0])
                       for t in required_affinity(g[0])), \
                f"k8s/{rel}: {g[0]['where']} mounts ReadWriteOnce {claim} but is not required onto its node"


def selects_all(selector, pods):
    want = selector.get("matchLabels", {})
    return bool(want) and not selector.get("matchExpressions") and all(
        all(p["labels"].get(k) == v for k, v in want.items()) for p in pods)


def required_affinity(pod):
    return pod["spec"].get("affinity", {}).get("podAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])


def claims(pod):
    return {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"].get("volumes", [])
            if "persistentVolumeClaim" in v}


def training_config(docs, pod, rel):
    """(path of --config in the trainer's argv, its JSON from the ConfigMap it is mounted from)."""
    c = trainer_container(pod)
    _, _, train = split_launch(container_argv(pod, c))
    cfg_path = flag_value(train, "--config")
    mount = [m for m in c["volumeMounts"] if cfg_path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mount) == 1, f"k8s/{rel}: --config {cfg_path} is on no volume"
    vol = [v for v in pod["spec"]["volumes"] if v["name"] == mount[0]["name"]][0]
    cm = one(docs, "ConfigMap", vol["configMap"]["name"])
    key = cfg_path[len(mount[0]["mountPath"].rstrip("/")) + 1:]
    assert key in cm["data"], f"k8s/{rel}: ConfigMap {cm['metadata']['name']} has no {key}"
    return json.loads(cm["data"][key])


@sized
def test_training_config_passes_tandem_train(rel):
    """The ConfigMap's JSON and the trainer's flags go through tandem-train's own parser and checks; a model folder
    that does not exist then stops it, which proves it got that far."""
    docs, js, trainers, _ = run_parts(rel)
    pod = trainers[0]
    _, _, train = split_launch(container_argv(pod, trainer_container(pod)))
    cfg_path = flag_value(train, "--config")
    cfg = training_config(docs, pod, rel)
    exe = binary("tandem-train")
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "grpo.json"
        # output_dir as in the pod would be /output/run: here a folder of the test, empty as on a first start.
        path.write_text(json.dumps({**cfg, "output_dir": str(pathlib.Path(tmp) / "run")}))
        argv = [exe, "--model", str(pathlib.Path(tmp) / "no-model")]
        for a in train:
            argv.append(str(path) if a == cfg_path else a)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT")}
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp, env=env)
    assert p.returncode == 1 and "no-model/config.json: cannot open" in p.stderr, \
        f"k8s/{rel}: tandem-train refused the config or the flags (exit {p.returncode}):\n{p.stderr}"
    if cfg.get("resume") == "auto":
        assert "resume auto: no complete checkpoint in" in p.stderr, p.stderr


# ---- Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards, v1.29 and later) ------

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def pss_violations(spec):
    """{(level, what)} that a pod spec breaks: level "baseline" (which restricted includes) or "restricted"."""
    out = set()
    psc = spec.get("securityContext", {})
    containers = spec.get("containers", []) + spec.get("initContainers", [])
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.add(("baseline", host))
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if "hostPath" in kinds:
            out.add(("baseline", f"hostPath volume {v['name']}"))
        if not kinds <= RESTRICTED_VOLUMES:
            out.add(("restricted", f"volume {v['name']} of type {sorted(kinds - RESTRICTED_VOLUMES)}"))

    def seccomp(sc):
        return (sc.get("seccompProfile") or {}).get("type")

    if seccomp(psc) == "Unconfined":
        out.add(("baseline", "pod seccompProfile Unconfined"))
    for c in containers:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            out.add(("baseline", f"{name}: privileged"))
        added = set((sc.get("capabilities") or {}).get("add", []))
        for cap in sorted(added - BASELINE_CAPABILITIES):
            out.add(("baseline", f"{name}: capability {cap}"))
        for cap in sorted(added - {"NET_BIND_SERVICE"}):
            out.add(("restricted", f"{name}: capability {cap}"))
        if "ALL" not in (sc.get("capabilities") or {}).get("drop", []):
            out.add(("restricted", f"{name}: capabilities.drop lacks ALL"))
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.add(("baseline", f"{name}: hostPort"))
        if sc.get("allowPrivilegeEscalation") is not False:
            out.add(("restricted", f"{name}: allowPrivilegeEscalation is not false"))
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.add(("restricted", f"{name}: runAsNonRoot is not true"))
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.add(("restricted", f"{name}: runAsUser 0"))
        profile = seccomp(sc) or seccomp(psc)
        if profile == "Unconfined":
            out.add(("baseline", f"{name}: seccompProfile Unconfined"))
        if profile not in ("RuntimeDefault", "Localhost"):
            out.add(("restricted", f"{name}: seccompProfile is {profile}, not RuntimeDefault or Localhost"))
    return out


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_pod_security_standards(rel):
    """`restricted` everywhere but the RDMA overlay, whose only violation is IPC_LOCK: beyond `baseline` as well,
    so its namespace must enforce `privileged` (docs/kubernetes.md)."""
    for pod in all_pods(render(rel)):
        found = pss_violations(pod["spec"])
        where = f"k8s/{rel}: {pod['where']}"
        if rel in RDMA:
            assert {w for _, w in found} == {f"{c['name']}: capability IPC_LOCK" for c in pod["spec"]["containers"]}, \
                f"{where}: {sorted(found)}"
            assert {lvl for lvl, _ in found} == {"baseline", "restricted"}
        else:
            assert not found, f"{where} breaks the restricted Pod Security Standard: {sorted(found)}"
        # The image's USER is 1000 too; runAsUser says so to the kubelet, which cannot read the image's passwd.
        assert pod["spec"]["securityContext"].get("runAsUser") == 1000, where


def test_pss_check_finds_violations():
    """The checker is not one that passes anything: the base trainer pod made root, privileged, with a hostPath."""
    js = the_jobset(render("base"), "base")
    spec = json.loads(json.dumps(pods_of(js, "trainer")[0]["spec"]))
    spec["securityContext"]["runAsNonRoot"] = False
    spec["containers"][0]["securityContext"]["privileged"] = True
    spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    found = pss_violations(spec)
    assert ("baseline", "trainer: privileged") in found and ("baseline", "hostPath volume host") in found
    assert ("restricted", "trainer: runAsNonRoot is not true") in found


# ---- nodes, RDMA, Kueue, disruptions ---------------------------------------------------------------------------


def image_architectures():
    """The CUDA architectures k8s/container/Dockerfile builds by default: (real, virtual) as sets of ints."""
    text = (K8S / "container" / "Dockerfile").read_text()
    m = re.search(r'^ARG CUDA_ARCHITECTURES="?([^"\n]+)"?$', text, re.M)
    assert m, "k8s/container/Dockerfile: no ARG CUDA_ARCHITECTURES default"
    real, virtual = set(), set()
    for a in m.group(1).split(";"):
        n, _, kind = a.partition("-")
        if kind in ("", "real"):
            real.add(int(n))
        if kind in ("", "virtual"):
            virtual.add(int(n))
    return real, virtual


def runs_on(cc, real, virtual):
    """Machine code for sm_XY runs on X.Y and later minors of X; PTX for compute_XY is compiled for any later GPU."""
    n = cc[0] * 10 + cc[1]
    return any(a // 10 == cc[0] and a <= n for a in real) or any(v <= n for v in virtual)


def test_image_builds_for_sm80_and_sm90():
    real, _ = image_architectures()
    assert {80, 90} <= real, f"k8s/container/Dockerfile builds machine code for {sorted(real)}"
    text = (K8S / "container" / "Dockerfile").read_text()
    assert re.search(r"^USER 1000$", text, re.M), "the image runs as uid 1000 (non-root, numeric)"


@sized
def test_gpu_pods_select_products_the_image_runs_on(rel):
    real, virtual = image_architectures()
    _, _, trainers, servers = run_parts(rel)
    for pod in (trainers[0], servers[0]):
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        for term in terms:
            exprs = [e for e in term["matchExpressions"] if e["key"] == "nvidia.com/gpu.product"]
            assert len(exprs) == 1 and exprs[0]["operator"] == "In", f"k8s/{rel}: {pod['where']}: no product choice"
            for product in exprs[0]["values"]:
                assert product in COMPUTE_CAPABILITY, \
                    f"k8s/{rel}: GPU product {product}: add its compute capability to COMPUTE_CAPABILITY here"
                assert runs_on(COMPUTE_CAPABILITY[product], real, virtual), \
                    f"k8s/{rel}: {product} (sm_{''.join(map(str, COMPUTE_CAPABILITY[product]))}) is not in the image"


@sized
def test_rdma_only_in_the_rdma_overlay(rel):
    _, _, trainers, servers = run_parts(rel)
    for pod in (trainers[0], servers[0]):
        c = [c for c in pod["spec"]["containers"] if program(c) in ("tandem-train", "tandem-serve")][0]
        env, res = container_env(pod, c), c["resources"]
        where = f"k8s/{rel}: {pod['where']}"
        if rel in RDMA:
            assert res["limits"].get(RDMA_RESOURCE) == 1 and res["requests"].get(RDMA_RESOURCE) == 1, where
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"], f"{where}: RDMA pins memory"
            assert env.get("NCCL_IB_DISABLE") == "0" and env.get("NCCL_IB_HCA"), where
            shm = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
            assert shm and shm[0]["emptyDir"]["medium"] == "Memory", where
        else:
            assert not [k for k in res.get("limits", {}) if k.startswith("rdma/")], where
            assert env.get("NCCL_IB_DISABLE") == "1", f"{where}: TCP overlays keep NCCL off IB devices"


@pytest.mark.parametrize("rel", sorted(SIZES))
def test_kueue_queue(rel):
    docs, js, _, _ = run_parts(rel)
    label = js["metadata"].get("labels", {}).get("kueue.x-k8s.io/queue-name")
    if rel not in QUEUED:
        assert label is None and not js["spec"].get("suspend"), f"k8s/{rel}: the base runs without Kueue"
        return
    assert label and js["spec"].get("suspend") is True, f"k8s/{rel}: queued JobSets are created suspended"
    queue = one(docs, "LocalQueue", label)
    assert queue["spec"]["clusterQueue"], f"k8s/{rel}: LocalQueue {label} names no ClusterQueue"


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_no_budget_blocks_drains(rel):
    """An evicted trainer pod restarts the run (not counted, resumed): a budget of 0 would only block drains."""
    for pdb in by_kind(render(rel), "PodDisruptionBudget"):
        assert pdb["spec"].get("maxUnavailable") not in (0, "0", "0%"), f"k8s/{rel}: {pdb['metadata']['name']}"


# ---- control channel keys and network policy -------------------------------------------------------------------


def secret_file(pod, c, path, where):
    """(Secret name, key) of the file at path in container c, which must come from a Secret volume item."""
    mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{where}: {path} is on no volume"
    vol = [v for v in pod["spec"]["volumes"] if v["name"] == mounts[0]["name"]][0]
    assert "secret" in vol, f"{where}: {path} must come from a Secret, not {sorted(vol)}"
    rel_path = path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
    items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
    assert rel_path in items, f"{where}: Secret volume {vol['name']} has no item {rel_path}"
    assert not vol["secret"].get("optional"), f"{where}: the keys must not be optional"
    assert vol["secret"].get("defaultMode", 0o644) & 0o007 == 0, f"{where}: key files readable by others"
    return vol["secret"]["secretName"], items[rel_path]


@sized
def test_control_channel_keys(rel, tmp_path):
    """Every rollout server is a CURVE server and every trainer rank its client, with files of one Secret whose
    keys are the files `tandem-train keygen` writes (so `kubectl create secret --from-file` of its folder fits)."""
    docs, js, trainers, servers = run_parts(rel)
    spod = servers[0]
    sc = server_container(spod)
    argv = container_argv(spod, sc)
    used = {secret_file(spod, sc, flag_value(argv, f), f"k8s/{rel}: {spod['where']}")
            for f in ("--control-key-file", "--control-authorized-keys")}
    pod = trainers[0]
    c = trainer_container(pod)
    _, _, train = split_launch(container_argv(pod, c))
    used |= {secret_file(pod, c, flag_value(train, f), f"k8s/{rel}: {pod['where']}")
             for f in ("--control-server-key", "--control-client-key")}
    names = {s for s, _ in used}
    assert len(names) == 1, f"k8s/{rel}: the keys come from several Secrets {names}"
    out = subprocess.run([binary("tandem-train"), "keygen", str(tmp_path / "keys")], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    written = {p.name for p in (tmp_path / "keys").iterdir()}
    assert {k for _, k in used} == written, f"k8s/{rel}: Secret keys {sorted(k for _, k in used)} vs keygen's {written}"
    # The Secret is the user's (never committed): the manifests must not ship one.
    assert not [d for d in docs if d["kind"] == "Secret"], f"k8s/{rel}: a Secret with keys is in the manifests"


def admitted(policy, labels, port):
    """Whether an ingress rule of policy admits a pod with these labels to this TCP port."""
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        assert peers, f"NetworkPolicy {policy['metadata']['name']}: a rule without 'from' admits everyone"
        ports = rule.get("ports")
        if ports and not any(p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
                             for p in ports):
            continue
        for p in peers:
            assert set(p) == {"podSelector"}, f"NetworkPolicy {policy['metadata']['name']}: only pods of the run"
            sel = p["podSelector"].get("matchLabels") or {}
            if sel and all(labels.get(k) == v for k, v in sel.items()):
                return True
    return False


@sized
def test_network_policy_admits_only_the_run(rel):
    docs, js, trainers, servers = run_parts(rel)
    policies = by_kind(docs, "NetworkPolicy")
    trainer, server = trainers[0]["labels"], servers[0]["labels"]
    other_run = {**trainer, "jobset.sigs.k8s.io/jobset-name": "another-run"}
    stranger = {"app.kubernetes.io/name": "something-else"}
    control = port_of(server_container(servers[0]), "control")
    http = port_of(server_container(servers[0]), "http")
    rendezvous = port_of(trainer_container(trainers[0]), "rendezvous")
    nccl = 40000   # an ephemeral port, where NCCL listens

    def policy_of(labels):
        sel = [p for p in policies if all(labels.get(k) == v for k, v in
                                          p["spec"]["podSelector"].get("matchLabels", {}).items())
               and "Ingress" in p["spec"].get("policyTypes", [])]
        assert sel, f"k8s/{rel}: no ingress NetworkPolicy selects pods labelled {labels}"
        return sel

    def admits(target, peer, port):
        return any(admitted(p, peer, port) for p in policy_of(target))

    # Rollout pods: the run's trainer pods, to the control port and NCCL's weight-sync ports only.
    assert admits(server, trainer, control) and admits(server, trainer, nccl)
    assert not admits(server, trainer, http)
    for peer in (stranger, other_run, server):
        assert not any(admits(server, peer, p) for p in (control, http, nccl)), peer
    # Trainer pods: each other (rendezvous, collectives) and the servers (NCCL weight sync), nobody else.
    assert admits(trainer, trainer, rendezvous) and admits(trainer, trainer, nccl) and admits(trainer, server, nccl)
    for peer in (stranger, other_run):
        assert not any(admits(trainer, peer, p) for p in (rendezvous, nccl)), peer
