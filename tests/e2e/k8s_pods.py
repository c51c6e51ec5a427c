"""What the manifests in k8s/ become in a cluster, for the tests: `kubectl kustomize` renders them, and the pods
of a JobSet are built the way its controllers build them (JobSet v0.12.0, pkg/controllers/jobset_controller.go:
constructJob, labelAndAnnotateObject; the Job controller for Indexed Jobs; the kubelet for the environment):

- JobSet J, replicated job R, Job index j (0 .. replicas-1), completion index i (0 .. completions-1): the Job is
  J-R-j, its pod has the host name J-R-j-i and, with network.enableDNSHostnames, the subdomain
  network.subdomain or J (the headless Service the controller makes);
- the pod's labels and annotations are the template's plus jobset.sigs.k8s.io/jobset-name = J,
  replicatedjob-name = R, job-index = j (and others the tests do not read); the Job controller annotates
  batch.kubernetes.io/job-completion-index = i and appends JOB_COMPLETION_INDEX = i to every container's env;
- the kubelet resolves env in order: a fieldRef reads the pod's metadata, a value's $(VAR) is replaced by a
  variable defined before it; then $(VAR) in command and args by any variable of the container.
"""
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import ROOT  # noqa: E402

K8S = ROOT / "k8s"
JOBSET = "jobset.x-k8s.io/v1alpha2"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
RJOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def kubectl():
    exe = pathlib.Path(sys.executable).parent / "kubectl"
    if not exe.exists():
        pytest.skip(f"{exe} is missing: scripts/setup.sh installs tests/requirements-k8s.txt into the test venv")
    return str(exe)


def render(rel):
    return render_dir(K8S / rel, f"k8s/{rel}")


def render_dir(path, name):
    p = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"kubectl kustomize {name} failed:\n{p.stderr}"
    docs = [d for d in yaml.safe_load_all(p.stdout) if d is not None]
    assert docs, f"{name} renders nothing"
    return docs


def jobsets(docs):
    return [d for d in docs if d["kind"] == "JobSet"]


def replicated_job(js, name):
    found = [r for r in js["spec"]["replicatedJobs"] if r["name"] == name]
    assert len(found) == 1, f'JobSet {js["metadata"]["name"]}: expected one replicated job {name!r}'
    return found[0]


def subdomain(js):
    net = js["spec"].get("network") or {}
    assert net.get("enableDNSHostnames") is True, f'JobSet {js["metadata"]["name"]}: network.enableDNSHostnames'
    return net.get("subdomain") or js["metadata"]["name"]


def pods_of(js, rjob_name):
    """Every pod the replicated job makes: dicts with name, host (host name), fqdn (host.subdomain), index
    (completion index), job_index, labels, annotations, spec (the pod template's spec)."""
    rj = replicated_job(js, rjob_name)
    job = rj["template"]["spec"]
    tmpl = job["template"]
    name = js["metadata"]["name"]
    assert job.get("completionMode") == "Indexed", f"{name}/{rjob_name}: the Job must be Indexed (stable host names)"
    out = []
    for j in range(rj.get("replicas", 1)):
        for i in range(job.get("completions", 1)):
            host = f"{name}-{rjob_name}-{j}-{i}"
            labels = {**(tmpl.get("metadata", {}).get("labels") or {}), JOBSET_NAME_LABEL: name,
                      RJOB_LABEL: rjob_name, JOB_INDEX_LABEL: str(j)}
            annotations = {**(tmpl.get("metadata", {}).get("annotations") or {}), JOBSET_NAME_LABEL: name,
                           RJOB_LABEL: rjob_name, JOB_INDEX_LABEL: str(j), COMPLETION_INDEX: str(i)}
            out.append({"name": host, "host": host, "fqdn": f"{host}.{subdomain(js)}", "index": i, "job_index": j,
                        "labels": labels, "annotations": annotations, "spec": tmpl["spec"],
                        "where": f"JobSet {name} pod {host}"})
    return out


def _expand(text, env, where, strict=True):
    def sub(m):
        if m.group(1) not in env:
            assert not strict, f"{where}: $({m.group(1)}) is not a variable defined before it"
            return m.group(0)   # the kubelet leaves an unknown reference as it is
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, str(text))


def _field(pod, path, where):
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        values = pod["labels"] if m.group(1) == "labels" else pod["annotations"]
        assert m.group(2) in values, f"{where}: the pod has no {m.group(1)[:-1]} {m.group(2)} for fieldRef {path}"
        return values[m.group(2)]
    if path == "metadata.name":
        return pod["name"]
    raise AssertionError(f"{where}: fieldRef {path} is not one the tests model")


def container_env(pod, c):
    """The container's environment as the kubelet gives it (variables from Secrets are left out)."""
    where = f'{pod["where"]} container {c["name"]}'
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(e["value"], env, f'{where} env {e["name"]}')
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = _field(pod, e["valueFrom"]["fieldRef"]["fieldPath"], where)
    env.setdefault("JOB_COMPLETION_INDEX", str(pod["index"]))
    return env


def container_argv(pod, c):
    env = container_env(pod, c)
    where = f'{pod["where"]} container {c["name"]}'
    return [_expand(a, env, where) for a in c.get("command", []) + c.get("args", [])]


def program(c):
    return (c.get("command") or [""])[0]


def trainer_container(pod):
    cs = [c for c in pod["spec"]["containers"] if program(c) == "tandem-train"]
    assert len(cs) == 1, f'{pod["where"]}: expected one tandem-train container'
    return cs[0]


def server_container(pod):
    cs = [c for c in pod["spec"]["containers"] if program(c) == "tandem-serve"]
    assert len(cs) == 1, f'{pod["where"]}: expected one tandem-serve container'
    return cs[0]


def the_jobset(docs, rel):
    found = jobsets(docs)
    assert len(found) == 1, f"k8s/{rel}: expected one JobSet (the run), found {len(found)}"
    return found[0]


def split_launch(argv):
    """tandem-train launch argv -> (launch options {flag: value}, --server-arg values, trainer argv after --)."""
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
