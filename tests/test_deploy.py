"""The container image and the KubeRay manifests (Dockerfile, .dockerignore, ops/kuberay/), checked by reading
them: no Docker, no Kubernetes, no Ray. The image's base is Ray's image at pyproject.toml's Ray pin and it
installs the project with `pip install .`; every path it copies exists and gets into the build context. Each
RayService manifest has the schema parts KubeRay reads, its serveConfigV2 is the application of its serve
config (validated with the app's own AppConfig), and its pods fit what that config asks Ray for."""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import yaml

from app.config import AppConfig

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "ops" / "kuberay"
MANIFESTS = {"rayservice-gpu.yaml": "serve_config.gpu.yaml", "rayservice-cpu.yaml": "serve_config.yaml"}
INGRESS_CPUS = 1.0  # Serve's default num_cpus for a replica; deployments/builder.py gives the Ingress no other
RANK_CPUS = 0.01  # the bundle of each TP rank after the first (deployments/builder.py)


# --- the Dockerfile ---------------------------------------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        keyword, _, args = current.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued instruction"
    return out


def dockerfile() -> list[tuple[str, str]]:
    return instructions((ROOT / "Dockerfile").read_text())


def arg_defaults(instrs: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in instrs if k == "ARG" and "=" in a)


def expand(value: str, args: dict[str, str]) -> str:
    """``value`` with the build arguments' defaults in place of ``${NAME}`` / ``$NAME`` (shell variables stay)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def ray_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d.split("==")[1] for d in deps if re.match(r"ray(\[[\w,]+\])?==", d)]
    assert len(pins) == 1, f"pyproject.toml pins ray once, as ray[serve]==X: {deps}"
    return pins[0]


def copies(instrs: list[tuple[str, str]]) -> list[str]:
    """The source paths of every COPY (options such as --chown dropped; the last argument is the destination)."""
    out = []
    for keyword, args in instrs:
        if keyword == "COPY":
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            assert len(words) >= 2, f"COPY {args}: a source and a destination"
            out += [w.rstrip("/") for w in words[:-1]]
    return out


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context: the last pattern that matches the path or
    a directory above it decides, a ``!`` pattern letting it back in."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    out = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            out = not keep
    return out


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_the_base_is_rays_image_at_the_ray_pin():
    instrs = dockerfile()
    froms = [a for k, a in instrs if k == "FROM"]
    assert len(froms) == 1, f"one stage, one FROM: {froms}"
    image = expand(froms[0].split()[0], arg_defaults(instrs))
    m = re.fullmatch(r"rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<py>3\d+)-(?P<platform>gpu|cu\d+)", image)
    assert m, f"the base is Ray's GPU image pinned by its tag (rayproject/ray:X.Y.Z-py3NN-gpu), not {image!r}"
    assert m["ray"] == ray_pin(), f"the base image's Ray {m['ray']} is not pyproject.toml's pin {ray_pin()}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert int(m["py"][1:]) >= int(requires.split(".")[1]), f"py{m['py']} against requires-python {requires}"


def test_the_image_installs_the_project_as_a_non_root_user():
    instrs = dockerfile()
    runs = [expand(a, arg_defaults(instrs)) for k, a in instrs if k == "RUN"]
    install = [i for i, r in enumerate(runs) if re.search(r"\bpip install \.(\s|$)", r)]
    assert install, "a RUN with `pip install .`"
    # torch's CUDA build first, at the Makefile's pin (pip install . then keeps it: torch>=2.5)
    torch_pin = re.search(r"^TORCH\s*\?=\s*(torch==\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    torch = [i for i, r in enumerate(runs) if re.search(rf"pip install \S*{re.escape(torch_pin)}", r)]
    assert torch and torch[0] < install[0], f"{torch_pin} is installed before `pip install .`"
    assert re.search(r"--index-url \S*download\.pytorch\.org/whl/cu\d+", runs[torch[0]]), \
        "torch comes from PyTorch's index of one CUDA version"
    users = [a for k, a in instrs if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"the image runs as a non-root user: {users}"
    assert not [a for k, a in instrs if k == "ENTRYPOINT"], "no ENTRYPOINT: KubeRay's `ray start` command runs as is"
    cmd = [a for k, a in instrs if k == "CMD"]
    assert cmd and cmd[-1].startswith('["serve", "run"'), f"CMD serves a serve config: {cmd}"
    served = re.findall(r"serve_config[\w.]*\.yaml", cmd[-1])
    assert served and set(served) <= set(copies(instrs)), f"the CMD's serve config is copied in: {served}"


def test_every_copied_path_exists_and_the_context_lets_it_in():
    instrs, patterns = dockerfile(), dockerignore()
    sources = copies(instrs)
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"the Dockerfile copies paths the repository lacks: {missing}"
    shut = [s for s in sources if ignored(s, patterns)]
    assert not shut, f".dockerignore keeps these out of the build context: {shut}"
    # every package pyproject.toml installs, the latency profiles read beside them, the serve configs
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in found["include"]}
    serve_configs = {p.name for p in ROOT.glob("serve_config*.yaml")}
    lacking = (packages | {"profiles", "pyproject.toml", "README.md"} | serve_configs) - set(sources)
    assert not lacking, f"the image lacks {sorted(lacking)}"
    # ...and what the image has no use for stays out (the check above can fail)
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", "reports/measurements.md",
                 "engine/__pycache__/x.pyc", "remask.egg-info/PKG-INFO"):
        assert ignored(path, patterns), f"{path} reaches the build context"


def test_the_image_puts_the_profiles_where_the_engine_reads_them():
    """The wheel carries the packages, not profiles/ (engine/latency_profile.py reads it beside them): the
    Dockerfile copies it next to the installed packages and checks from outside the source tree."""
    runs = " ".join(a for k, a in dockerfile() if k == "RUN")
    assert re.search(r"cp -r profiles \"\$SITE/profiles\"", runs) and "python -P -c" in runs
    from engine.latency_profile import PROFILES_DIR

    assert PROFILES_DIR.name == "profiles" and PROFILES_DIR.parent == ROOT


_INSTALLED_CHECK = textwrap.dedent("""
    import sys
    from pathlib import Path

    import yaml

    import engine
    from app.config import AppConfig
    from engine.latency_profile import PROFILES_DIR, load_tp_profiles
    from engine.loading import DEFAULT_MODELS, resolve_model

    site = Path(sys.argv[1])
    assert Path(engine.__file__).is_relative_to(site), engine.__file__  # the installed copy, not a source tree
    assert PROFILES_DIR.is_relative_to(site) and PROFILES_DIR.is_dir(), PROFILES_DIR
    for name in DEFAULT_MODELS:
        assert (resolve_model(name) / "config.json").is_file(), name
    for config in sys.argv[2:]:
        cfg = AppConfig.model_validate(yaml.safe_load(Path(config).read_text())["applications"][0]["args"])
        assert sorted(load_tp_profiles(cfg.profile_name(), cfg.resources.tp_degrees)) == cfg.resources.tp_degrees
    import deployments.builder  # noqa: F401
    print("ok")
""")


@pytest.mark.slow
def test_the_installed_project_holds_what_the_app_reads(tmp_path):
    """What the image's `pip install .` leaves: the build context as the Dockerfile copies it, built into a wheel
    and installed into a directory of its own; then the Dockerfile's own commands after `pip install .` run
    there (the profiles beside the packages). Every file of every package arrives, and from outside any source
    tree the installed app finds its embedded models and the latency profiles of both serve configs."""
    pytest.importorskip("setuptools", minversion="77")  # bdist_wheel built in; an SPDX license string
    instrs = dockerfile()
    context, site, wheels = tmp_path / "context", tmp_path / "site", tmp_path / "wheels"
    for src in copies(instrs):
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))
        else:
            (context / src).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / src, context / src)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."], cwd=context,
                   check=True, capture_output=True, timeout=240)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), *map(str, wheels.glob("*.whl"))],
                   check=True, capture_output=True, timeout=120)
    install = next(a for k, a in instrs if k == "RUN" and re.search(r"\bpip install \.(\s|$)", a))
    after = install.split("&&", 1)[1]  # the Dockerfile's commands after `pip install .`
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "-c", f"set -e; {after}"], cwd=context, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    packages = {p.rstrip("*") for p in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                ["packages"]["find"]["include"]}
    missing = [str(f.relative_to(ROOT)) for pkg in sorted(packages) for f in (ROOT / pkg).rglob("*")
               if f.is_file() and "__pycache__" not in f.parts and not (site / f.relative_to(ROOT)).is_file()]
    assert not missing, f"the wheel lacks package files (a directory without __init__.py, data not in package-data): " \
                        f"{missing[:10]}"
    configs = [str(context / c) for c in MANIFESTS.values()]
    done = subprocess.run([sys.executable, "-P", "-c", _INSTALLED_CHECK, str(site), *configs], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# --- the RayService manifests ------------------------------------------------------------------------------

def manifest(name: str) -> dict:
    data = yaml.safe_load((KUBERAY / name).read_text())
    assert isinstance(data, dict), name
    return data


def serve_config_v2(name: str) -> dict:
    text = manifest(name)["spec"]["serveConfigV2"]
    assert isinstance(text, str), "serveConfigV2 is a YAML document in a string (a `|` block)"
    return yaml.safe_load(text)


def app_config(name: str) -> AppConfig:
    apps = serve_config_v2(name)["applications"]
    assert len(apps) == 1
    return AppConfig.model_validate(apps[0]["args"])


def groups(name: str) -> list[dict]:
    cluster = manifest(name)["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]


def container(group: dict) -> dict:
    containers = group["template"]["spec"]["containers"]
    assert containers, "a pod template with a container"
    return containers[0]


def cpus(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def ray_cpus(group: dict) -> float:
    """The CPUs Ray counts on one pod of the group: rayStartParams num-cpus, else the container's CPU limit."""
    params = group.get("rayStartParams") or {}
    return cpus(params.get("num-cpus", container(group)["resources"]["limits"]["cpu"]))


def pod_gpus(group: dict) -> int:
    res = container(group).get("resources", {})
    limit = res.get("limits", {}).get("nvidia.com/gpu", 0)
    assert str(res.get("requests", {}).get("nvidia.com/gpu", limit)) == str(limit), "GPU requests = limits"
    return int(limit)


def replica_cpus(cfg: AppConfig, d: int) -> float:
    """What one Denoiser_TP<d> replica's placement group takes (deployments/builder.py's bundles)."""
    return cfg.resources.cpus_per_replica + RANK_CPUS * (d - 1)


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_the_manifest_is_a_rayservice(name):
    data = manifest(name)
    assert data["apiVersion"] == "ray.io/v1" and data["kind"] == "RayService"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", data["metadata"]["name"])
    spec = data["spec"]
    assert set(spec) == {"serveConfigV2", "rayClusterConfig"}
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_pin(), "rayVersion is the image's Ray"
    head, *workers = groups(name)
    assert workers, "a worker group runs the Denoisers"
    images = set()
    for group in [head, *workers]:
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), f"rayStartParams are strings: {params}"
        c = container(group)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", c["name"]) and c["image"]
        images.add(c["image"])
        assert cpus(c["resources"]["limits"]["cpu"]) > 0
    assert len(images) == 1, f"head and workers run one image (one Ray, one Python): {images}"
    for group in workers:
        assert group["groupName"] and group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    ports = {p["name"]: p["containerPort"] for p in container(head)["ports"]}
    assert ports.get("serve") == serve_config_v2(name)["http_options"]["port"] and ports.get("dashboard") == 8265
    # the volumes each container mounts are declared in its pod
    for group in [head, *workers]:
        declared = {v["name"] for v in group["template"]["spec"].get("volumes", [])}
        mounted = {m["name"] for m in container(group).get("volumeMounts", [])}
        assert mounted <= declared, f"mounts without a volume: {mounted - declared}"


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_serve_config_v2_is_the_serve_configs_application(name):
    ours, theirs = serve_config_v2(name), yaml.safe_load((ROOT / MANIFESTS[name]).read_text())
    assert ours["applications"] == theirs["applications"], \
        f"{name}'s serveConfigV2 is not {MANIFESTS[name]}'s: run python ops/kuberay/sync_serve_config.py"
    assert ours.get("proxy_location") == theirs.get("proxy_location")
    assert ours["http_options"] == {**theirs["http_options"], "host": "0.0.0.0"}, \
        "the same port, on every interface (the Kubernetes Service reaches the proxy in the head pod)"
    app = ours["applications"][0]
    assert app["import_path"] == "deployments.builder:build_app"
    cfg = AppConfig.model_validate(app["args"])  # the application's own validation, as build_app does it
    assert cfg == AppConfig.model_validate(theirs["applications"][0]["args"])


def load_sync():
    spec = importlib.util.spec_from_file_location("sync_serve_config", KUBERAY / "sync_serve_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_manifests_are_what_the_sync_script_writes():
    sync = load_sync()
    assert sync.MANIFESTS == MANIFESTS
    for name in MANIFESTS:
        assert (KUBERAY / name).read_text() == sync.expected(name), \
            f"{name} is out of date: run python ops/kuberay/sync_serve_config.py"
    assert sync.main(["--check"]) == 0


def test_the_sync_script_replaces_only_the_block():
    sync = load_sync()
    text = (KUBERAY / "rayservice-cpu.yaml").read_text()
    serve = sync.serve_config_text((ROOT / "serve_config.yaml").read_text().replace("slots: 32", "slots: 8"))
    assert serve.startswith("proxy_location:") and "host: 0.0.0.0" in serve and "127.0.0.1" not in serve
    changed = sync.render(text, serve)
    assert changed != text and sync.render(changed, sync.serve_config_text(
        (ROOT / "serve_config.yaml").read_text())) == text  # and back, byte for byte
    old, new = yaml.safe_load(text), yaml.safe_load(changed)
    assert yaml.safe_load(new["spec"].pop("serveConfigV2"))["applications"][0]["args"]["engine"]["slots"] == 8
    old["spec"].pop("serveConfigV2")
    assert old == new  # nothing but the block changed
    with pytest.raises(ValueError, match="serveConfigV2"):
        sync.render("spec:\n  rayClusterConfig: {}\n", serve)
    with pytest.raises(ValueError, match="http_options.host"):
        sync.serve_config_text("applications: []\n")


def test_the_gpu_workers_fit_the_gpu_config():
    cfg, (head, *workers) = app_config("rayservice-gpu.yaml"), groups("rayservice-gpu.yaml")
    res, planner = cfg.resources, cfg.planner
    assert cfg.engine.device == "cuda" and res.gpus_per_rank >= 1 and planner is not None
    assert head["rayStartParams"].get("num-gpus") == "0" and pod_gpus(head) == 0, "the head is CPU-only"
    assert ray_cpus(head) >= INGRESS_CPUS, "the head can hold the Ingress"
    gpu_groups = [g for g in workers if pod_gpus(g)]
    assert gpu_groups, "a GPU worker group"
    for group in gpu_groups:
        gpus = pod_gpus(group)
        assert group["rayStartParams"].get("num-gpus") == str(gpus), "Ray's GPUs = the pod's nvidia.com/gpu"
        assert gpus == planner.gpus_per_node, f"a pod is one of the planner's nodes: {planner.gpus_per_node} GPUs"
        for d in res.tp_degrees:  # every TP group fits in one pod (NCCL within a node), the pod fills up with them
            group_gpus = d * res.gpus_per_rank
            assert gpus % group_gpus == 0, f"TP-{d} takes {group_gpus:g} GPUs: {gpus} is not a multiple"
            need = gpus // group_gpus * replica_cpus(cfg, d)
            assert ray_cpus(group) >= need, f"{gpus // group_gpus:g} TP-{d} replicas need {need:g} CPUs"
    assert sum(g["maxReplicas"] for g in gpu_groups) == planner.nodes, "the autoscaler's bound is the planner's"
    assert manifest("rayservice-gpu.yaml")["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling") is True


def test_the_gpu_pods_mount_the_model_and_the_image_has_the_profile():
    cfg = app_config("rayservice-gpu.yaml")
    model = cfg.engine.model
    assert model.startswith("/"), "a model directory on a volume"
    for group in groups("rayservice-gpu.yaml"):  # the Ingress reads the tokenizer, the Denoisers the weights
        mounts = [m["mountPath"].rstrip("/") + "/" for m in container(group).get("volumeMounts", [])]
        assert any(model.startswith(m) for m in mounts), f"{container(group)['name']} does not mount {model}"
    from engine.latency_profile import load_tp_profiles

    profiles = load_tp_profiles(cfg.profile_name(), cfg.resources.tp_degrees)  # from profiles/, copied in
    assert sorted(profiles) == cfg.resources.tp_degrees


def test_the_cpu_cluster_fits_the_cpu_config():
    cfg, all_groups = app_config("rayservice-cpu.yaml"), groups("rayservice-cpu.yaml")
    assert cfg.engine.device == "cpu" and cfg.resources.gpus_per_rank == 0 and cfg.planner is None
    assert not any(pod_gpus(g) for g in all_groups), "no GPU anywhere: it runs on kind or minikube"
    capacity = sum(ray_cpus(g) * g.get("minReplicas", 1) for g in all_groups)
    need = INGRESS_CPUS + sum(cfg.resources.replicas.get(d, 1) * replica_cpus(cfg, d) for d in cfg.resources.tp_degrees)
    assert capacity >= need, f"the cluster's {capacity:g} CPUs hold the app's {need:g}"
    for group in all_groups:  # Ray's count of a pod's CPUs is at most what the pod may use
        assert ray_cpus(group) <= cpus(container(group)["resources"]["limits"]["cpu"])
