# Remask's container image: the Ray Serve application and everything it imports, on Ray's own image, so that
# KubeRay can run it as the head and the workers of a RayService (ops/kuberay/, docs/deploy.md).
#
#   docker build -t remask:0.1.0 .                                   # GPU: CUDA build of torch
#   docker run --gpus all -p 8000:8000 -v /data/models:/data/models remask:0.1.0   # serve_config.gpu.yaml
#
# A CPU image for a local cluster (kind, minikube) swaps the base and the torch wheels:
#   docker build -t remask:0.1.0-cpu --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# The base's Ray version is pyproject.toml's pin (ray[serve]==2.60.0) and the RayService's rayVersion:
# tests/test_deploy.py keeps the three equal. The image has no ENTRYPOINT of its own: KubeRay replaces the
# container's command with its `ray start` line, which finds `ray` on the PATH of Ray's image; CMD is only
# what a plain `docker run` starts.
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${BASE_IMAGE}

# torch's CUDA build comes from PyTorch's index for one CUDA version: cu130 needs an NVIDIA driver >= 580
# (what the H200 nodes run); pick cu128 for drivers >= 570. The version is the Makefile's pin.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Ray's image runs as its non-root user `ray` (uid 1000, group users) with Python in /home/ray/anaconda3,
# which that user owns: everything below installs and runs as `ray`, never as root.
USER ray
# made by `ray` first: a directory WORKDIR creates belongs to root, and `pip install .` writes its build there
RUN mkdir -p /home/ray/remask
WORKDIR /home/ray/remask

# torch first, in a layer of its own (about 3 GB with its CUDA libraries): a code change does not fetch it again
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# the project: pyproject.toml's packages (tool.setuptools.packages.find) and what they read at run time
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users app/ app/
COPY --chown=ray:users cluster/ cluster/
COPY --chown=ray:users deployments/ deployments/
COPY --chown=ray:users engine/ engine/
COPY --chown=ray:users loadgen/ loadgen/
COPY --chown=ray:users planner/ planner/
COPY --chown=ray:users predictors/ predictors/
COPY --chown=ray:users sim/ sim/
COPY --chown=ray:users tasksuite/ tasksuite/
COPY --chown=ray:users tools/ tools/
COPY --chown=ray:users profiles/ profiles/

# `pip install .` keeps the torch above (it satisfies torch>=2.5) and Ray's (the pin matches the base). The
# latency profiles are read beside the packages (engine/latency_profile.py: PROFILES_DIR), which the wheel
# does not carry: they are copied next to the installed packages, where every Ray worker imports them from.
# (`python -P`: the installed packages, not this source tree in the current directory.)
RUN pip install . \
 && SITE="$(python -P -c 'import engine, os; print(os.path.dirname(os.path.dirname(engine.__file__)))')" \
 && cp -r profiles "$SITE/profiles" \
 && python -P -c "import deployments.builder, engine.latency_profile as p; assert p.PROFILES_DIR.is_dir(), p.PROFILES_DIR"

# the serve configs: `serve run serve_config.gpu.yaml` (8 GPUs, LLaDA-8B from /data/models) or serve_config.yaml
COPY --chown=ray:users serve_config.yaml serve_config.gpu.yaml serve_config.checkpoint.yaml ./

# Serve's HTTP port; Ray's GCS, dashboard and client ports (KubeRay names them in the pod spec)
EXPOSE 8000 6379 8265 10001

CMD ["serve", "run", "serve_config.gpu.yaml"]
